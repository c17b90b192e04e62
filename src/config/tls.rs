//! `[tls]`: where the server's certificate, key and client CA are.
//!
//! Only the shape is checked here (both files named when the section exists); reading them,
//! matching the key to the certificate and the expiry are checked at server start by
//! [`crate::server::tls::server_config`], each error naming the key and the path.

use super::ConfigError;
use std::path::PathBuf;

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
