//! `[tls]`: where the server's certificate, key and client CA are; `[cluster.tls]`: where a
//! cluster member's peer certificate, key and CA are.
//!
//! Only the shape is checked here (every required file named when the section exists);
//! reading them, matching the key to the certificate and the expiry are checked at server
//! start by [`crate::server::tls::server_config`] and `cluster::peer::tls` (which also checks
//! that the peer certificate names this member), each error naming the key and the path.

use super::{described, ConfigError};
use std::path::PathBuf;
use toml::Value;

/// `[tls]`.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct TlsConfig {
    /// `tls.cert_file`: the server's certificate chain, PEM, end-entity first. Required.
    pub cert_file: PathBuf,
    /// `tls.key_file`: the server's private key, PEM (PKCS#8, PKCS#1 or SEC1). Required.
    pub key_file: PathBuf,
    /// `tls.client_ca_file`: when set, every client must present a certificate signed by one
    /// of these CA certificates (PEM).
    pub client_ca_file: Option<PathBuf>,
}

impl TlsConfig {
    /// Refuses a `[tls]` section without its certificate or key.
    pub(super) fn check_required(&self) -> Result<(), ConfigError> {
        for (key, path) in [
            ("tls.cert_file", &self.cert_file),
            ("tls.key_file", &self.key_file),
        ] {
            if path.as_os_str().is_empty() {
                let message = format!("{key}: required when [tls] is present");
                return Err(ConfigError::new(key, None, message));
            }
        }
        Ok(())
    }
}

/// `[cluster.tls]`: with it every peer connection is TLS both ways, each member presenting its
/// certificate (which must name it as the DNS SAN `member-N`, N its node id) and checking the
/// other's against `ca_file`. All three keys are required.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct PeerTlsConfig {
    /// `cluster.tls.cert_file`: this member's certificate chain, PEM, end-entity first.
    pub cert_file: PathBuf,
    /// `cluster.tls.key_file`: this member's private key, PEM (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// `cluster.tls.ca_file`: the CA certificates a peer's certificate must chain to (PEM; it
    /// may hold several, so that old and new CAs overlap during a rotation).
    pub ca_file: PathBuf,
}

/// The keys of `[cluster.tls]`, in the example file's order.
pub(super) const PEER_TLS_KEYS: [&str; 3] = ["cert_file", "key_file", "ca_file"];

/// Reads `[cluster.tls]` (`value`, the `tls` key of `[cluster]`, on line `line`): a table of
/// the three files, each a non-empty string, none missing, no other key.
pub(super) fn read_peer_tls(value: &Value, line: usize) -> Result<PeerTlsConfig, ConfigError> {
    let error = |path: &str, problem: String| {
        ConfigError::new(path, Some(line), format!("{path}: {problem}"))
    };
    let Value::Table(table) = value else {
        let problem = format!(
            "expected a section ([cluster.tls]), got {}",
            described(value)
        );
        return Err(error("cluster.tls", problem));
    };
    if let Some(key) = table
        .keys()
        .find(|key| !PEER_TLS_KEYS.contains(&key.as_str()))
    {
        let problem = format!("unknown key (known keys: {})", PEER_TLS_KEYS.join(", "));
        return Err(error(&format!("cluster.tls.{key}"), problem));
    }
    let file = |key: &str| {
        let path = format!("cluster.tls.{key}");
        match table.get(key) {
            Some(Value::String(text)) if !text.is_empty() => Ok(PathBuf::from(text)),
            Some(Value::String(_)) => Err(error(&path, "expected a file path, got \"\"".into())),
            Some(other) => Err(error(
                &path,
                format!("expected a string, got {}", described(other)),
            )),
            None => Err(error(&path, "required with [cluster.tls]".into())),
        }
    };
    Ok(PeerTlsConfig {
        cert_file: file("cert_file")?,
        key_file: file("key_file")?,
        ca_file: file("ca_file")?,
    })
}
