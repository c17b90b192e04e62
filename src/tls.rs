//! TLS files and configurations: reading PEM certificates and keys, checking them, and building
//! the rustls configurations of the server and of the client.
//!
//! Every error names the configuration key (or command-line flag) and the path it is about, on
//! one line, e.g. `tls.key_file /etc/latchkey/server.key: does not match tls.cert_file ...`.
//! Files are read whole, at most [`PEM_FILE_BYTES_MAX`] each, once at start.
//!
//! The crypto provider is rustls's `ring` (no cmake or assembler needed to build). The expiry of
//! our own certificate (rustls checks the validity of the peer's, not of ours) and a client
//! certificate's identities are read with `x509-parser`.
//!
//! A client's configuration and the name it expects of the server make a [`Connector`], which
//! starts each connection: the official client's sessions, `latchkey stats` and `keys`, and
//! `latchkey bench` all connect through one.
//!
//! Not here: the TLS stream of a server session ([`crate::server::tls`]), the client's stream
//! ([`crate::client`]).

use crate::config::TlsConfig;
use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ClientConnection, RootCertStore, ServerConfig, StreamOwned};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

/// The largest PEM file read (certificate chains and CA bundles are a few KiB).
pub const PEM_FILE_BYTES_MAX: u64 = 1 << 20;

/// The crypto provider of every configuration.
fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// An error about the file `path` named by `key`.
fn file_error(key: &str, path: &Path, cause: impl std::fmt::Display) -> io::Error {
    let message = format!("{key} {}: {cause}", path.display());
    io::Error::new(io::ErrorKind::InvalidInput, message)
}

fn read_pem(key: &str, path: &Path) -> io::Result<Vec<u8>> {
    let length = std::fs::metadata(path)
        .map_err(|e| file_error(key, path, format!("cannot read: {e}")))?
        .len();
    if length > PEM_FILE_BYTES_MAX {
        let cause = format!("larger than {PEM_FILE_BYTES_MAX} bytes ({length})");
        return Err(file_error(key, path, cause));
    }
    std::fs::read(path).map_err(|e| file_error(key, path, format!("cannot read: {e}")))
}

/// Every certificate in the PEM file `path` (at least one), each checked for expiry.
pub fn load_certs(key: &str, path: &Path) -> io::Result<Vec<CertificateDer<'static>>> {
    let pem = read_pem(key, path)?;
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<_, _>>()
        .map_err(|e| file_error(key, path, format!("invalid PEM: {e}")))?;
    if certs.is_empty() {
        return Err(file_error(key, path, "no certificate in it"));
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |since| since.as_secs());
    for cert in &certs {
        match not_after_unix(cert) {
            Some(not_after) if not_after < now => {
                let cause = format!("certificate expired ({} s ago)", now - not_after);
                return Err(file_error(key, path, cause));
            }
            Some(_) => {}
            None => {
                return Err(file_error(
                    key,
                    path,
                    "cannot read a certificate's validity",
                ))
            }
        }
    }
    Ok(certs)
}

/// The private key in the PEM file `path`.
pub fn load_key(key: &str, path: &Path) -> io::Result<PrivateKeyDer<'static>> {
    let pem = read_pem(key, path)?;
    PrivateKeyDer::from_pem_slice(&pem)
        .map_err(|e| file_error(key, path, format!("no private key in it: {e}")))
}

fn root_store(key: &str, path: &Path) -> io::Result<Arc<RootCertStore>> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(key, path)? {
        roots
            .add(cert)
            .map_err(|e| file_error(key, path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(Arc::new(roots))
}

/// The server's configuration from `[tls]`: every file read and checked (see the module docs).
pub fn server_config(tls: &TlsConfig) -> io::Result<Arc<ServerConfig>> {
    let certs = load_certs("tls.cert_file", &tls.cert_file)?;
    let key = load_key("tls.key_file", &tls.key_file)?;
    let provider = provider();
    let builder = ServerConfig::builder_with_provider(Arc::clone(&provider))
        .with_safe_default_protocol_versions()
        .map_err(io::Error::other)?;
    let builder = match &tls.client_ca_file {
        Some(path) => {
            let roots = root_store("tls.client_ca_file", path)?;
            let verifier = WebPkiClientVerifier::builder_with_provider(roots, provider)
                .build()
                .map_err(|e| file_error("tls.client_ca_file", path, e))?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let config = builder.with_single_cert(certs, key).map_err(|e| {
        let cause = format!(
            "does not fit tls.cert_file {}: {e}",
            tls.cert_file.display()
        );
        file_error("tls.key_file", &tls.key_file, cause)
    })?;
    Ok(Arc::new(config))
}

/// The client's TLS files (see `ClientConfig`'s TLS settings).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientFiles {
    /// The CA certificates that must have signed the server's certificate (`--tls-ca`).
    pub ca_file: std::path::PathBuf,
    /// The client's certificate chain and key (`--tls-cert`, `--tls-key`), if it presents one.
    pub cert_and_key: Option<(std::path::PathBuf, std::path::PathBuf)>,
}

/// The client's configuration from its files.
pub fn client_config(files: &ClientFiles) -> io::Result<Arc<ClientConfig>> {
    let roots = root_store("--tls-ca", &files.ca_file)?;
    let provider = provider();
    let verifier = WebPkiServerVerifier::builder_with_provider(roots, Arc::clone(&provider))
        .build()
        .map_err(|e| file_error("--tls-ca", &files.ca_file, e))?;
    let builder = ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(io::Error::other)?
        .with_webpki_verifier(verifier);
    let config = match &files.cert_and_key {
        Some((cert_path, key_path)) => {
            let certs = load_certs("--tls-cert", cert_path)?;
            let key = load_key("--tls-key", key_path)?;
            builder.with_client_auth_cert(certs, key).map_err(|e| {
                let cause = format!("does not fit --tls-cert {}: {e}", cert_path.display());
                file_error("--tls-key", key_path, cause)
            })?
        }
        None => builder.with_no_client_auth(),
    };
    Ok(Arc::new(config))
}

/// A client's TLS, ready to start connections: its configuration (from [`ClientFiles`]) and
/// the name the server's certificate must carry.
#[derive(Clone, Debug)]
pub struct Connector {
    config: Arc<ClientConfig>,
    /// `None`: the IP address connected to, which the certificate must carry as an IP SAN.
    server_name: Option<ServerName<'static>>,
}

impl Connector {
    /// Reads and checks the files, and checks `server_name` (`--tls-server-name`): errors name
    /// the flag and the path or the name.
    pub fn new(files: &ClientFiles, server_name: Option<&str>) -> io::Result<Connector> {
        let config = client_config(files)?;
        let server_name = match server_name {
            Some(name) => Some(ServerName::try_from(name.to_owned()).map_err(|e| {
                let message = format!("--tls-server-name {name}: {e}");
                io::Error::new(io::ErrorKind::InvalidInput, message)
            })?),
            None => None,
        };
        Ok(Connector {
            config,
            server_name,
        })
    }

    /// A new client connection to the server at `addr` (its handshake not started).
    pub fn connection(&self, addr: SocketAddr) -> io::Result<ClientConnection> {
        let name = match &self.server_name {
            Some(name) => name.clone(),
            None => ServerName::IpAddress(addr.ip().into()),
        };
        ClientConnection::new(Arc::clone(&self.config), name).map_err(io::Error::other)
    }

    /// A TLS session over the blocking connection `tcp` to `addr`, its handshake done (and the
    /// client's last flight written) by `deadline`. Errors: `TimedOut` past the deadline,
    /// `InvalidData` with rustls's reason when the handshake is refused (after sending the
    /// alert, best effort), `UnexpectedEof` when the server closes first. The socket keeps
    /// read and write timeouts of at most the time that was left.
    pub fn handshake(
        &self,
        mut tcp: TcpStream,
        addr: SocketAddr,
        deadline: Instant,
    ) -> io::Result<StreamOwned<ClientConnection, TcpStream>> {
        let mut tls = self.connection(addr)?;
        while tls.is_handshaking() || tls.wants_write() {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                let message = "the TLS handshake timed out";
                return Err(io::Error::new(io::ErrorKind::TimedOut, message));
            }
            tcp.set_read_timeout(Some(left))?;
            tcp.set_write_timeout(Some(left))?;
            match handshake_step(&mut tls, &mut tcp) {
                Ok(()) => {}
                // A socket timeout (`WouldBlock` on Unix): the deadline check above says so.
                Err(error) if is_retry(&error) => {}
                Err(error) => return Err(error),
            }
        }
        Ok(StreamOwned::new(tls, tcp))
    }
}

/// One blocking step of a client's handshake: write what rustls holds, else read and process.
fn handshake_step(tls: &mut ClientConnection, tcp: &mut TcpStream) -> io::Result<()> {
    if tls.wants_write() {
        return tls.write_tls(tcp).map(drop);
    }
    if tls.read_tls(tcp)? == 0 {
        let message = "the server closed the connection during the TLS handshake";
        return Err(io::Error::new(io::ErrorKind::UnexpectedEof, message));
    }
    if let Err(error) = tls.process_new_packets() {
        // The alert that tells the server why, best effort.
        let _ = tls.write_tls(tcp);
        if let rustls::Error::InvalidMessage(_) = error {
            let message = format!("{error} (does the server speak TLS?)");
            return Err(io::Error::new(io::ErrorKind::InvalidData, message));
        }
        return Err(io::Error::new(io::ErrorKind::InvalidData, error));
    }
    Ok(())
}

/// Whether a blocking socket's error only means "try again" (a signal, or a timeout).
fn is_retry(error: &io::Error) -> bool {
    matches!(
        error.kind(),
        io::ErrorKind::Interrupted | io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

// ----- what a certificate says ---------------------------------------------------------------

/// The end of a certificate's validity, in seconds since the Unix epoch (`None`: malformed, or
/// before the epoch).
pub fn not_after_unix(cert: &[u8]) -> Option<u64> {
    let (_, cert) = X509Certificate::from_der(cert).ok()?;
    u64::try_from(cert.validity().not_after.timestamp()).ok()
}

/// A client certificate's identities (see [`crate::auth`]): its subject's common names, then
/// its DNS subject alternative names, in certificate order. Names that are not UTF-8 strings
/// are left out; a malformed certificate (rustls verified it, so this does not happen) has
/// none. At most [`IDENTITIES_MAX`].
pub fn certificate_identities(cert: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = X509Certificate::from_der(cert) else {
        return Vec::new();
    };
    let common_names = cert
        .subject()
        .iter_common_name()
        .filter_map(|name| name.as_str().ok());
    let alternative_names = cert.subject_alternative_name().ok().flatten();
    let dns_names = alternative_names
        .iter()
        .flat_map(|extension| extension.value.general_names.iter())
        .filter_map(|name| match name {
            GeneralName::DNSName(name) => Some(*name),
            _ => None,
        });
    common_names
        .chain(dns_names)
        .take(IDENTITIES_MAX)
        .map(str::to_string)
        .collect()
}

/// Identities read from one certificate at most.
pub const IDENTITIES_MAX: usize = 64;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_certificates_have_no_expiry_and_no_identity() {
        for bytes in [&[][..], &[0x30, 0x85, 0, 0, 0, 0, 0], b"not a certificate"] {
            assert_eq!(not_after_unix(bytes), None);
            assert!(certificate_identities(bytes).is_empty());
        }
    }
}
