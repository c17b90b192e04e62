//! TLS on the server: its rustls configuration from `[tls]`, the identities a client
//! certificate proves, and the TLS stream of a session ([`TlsStream`], shared with the client)
//! seen as a [`Stream`] the core runs over unchanged.
//!
//! The certificate files are read and checked by the client crate's `tls` module (one reader
//! for both ends); a client certificate's identities are read with `x509-parser`.
//!
//! A handshake must finish within [`HANDSHAKE_DEADLINE`] (the core enforces it, see
//! [`Stream::handshaking`]).

use super::net::{MioStream, Stream};
use crate::config::TlsConfig;
use latchkey_client::tls::{file_error, load_certs, load_key, provider, root_store, TlsStream};
use mio::net::TcpStream;
use rustls::server::WebPkiClientVerifier;
use rustls::ServerConfig;
use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};

/// How long a client has from its connection to the end of its handshake.
pub const HANDSHAKE_DEADLINE: Duration = Duration::from_secs(10);

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
    common_names
        .chain(dns_names(&cert))
        .take(IDENTITIES_MAX)
        .map(str::to_string)
        .collect()
}

/// A certificate's DNS subject alternative names alone, in certificate order (what a peer
/// certificate's member name is read from: `cluster::peer::tls`); none for a malformed one. At
/// most [`IDENTITIES_MAX`].
pub fn certificate_dns_names(cert: &[u8]) -> Vec<String> {
    let Ok((_, cert)) = X509Certificate::from_der(cert) else {
        return Vec::new();
    };
    (dns_names(&cert).take(IDENTITIES_MAX))
        .map(str::to_string)
        .collect()
}

fn dns_names<'a>(cert: &'a X509Certificate<'_>) -> impl Iterator<Item = &'a str> {
    let alternative_names = cert.subject_alternative_name().ok().flatten();
    alternative_names
        .into_iter()
        .flat_map(|extension| extension.value.general_names.iter())
        .filter_map(|name| match name {
            GeneralName::DNSName(name) => Some(*name),
            _ => None,
        })
}

/// Identities read from one certificate at most.
pub const IDENTITIES_MAX: usize = 64;

impl Stream for TlsStream {
    fn shutdown_write(&mut self) -> io::Result<()> {
        TlsStream::shutdown_write(self)
    }

    fn peer(&self) -> Option<SocketAddr> {
        TlsStream::peer(self)
    }

    #[inline]
    fn wants_write(&self) -> bool {
        TlsStream::wants_write(self)
    }

    fn handshaking(&self) -> bool {
        TlsStream::handshaking(self)
    }

    fn tls_error(&self) -> Option<String> {
        TlsStream::tls_error(self)
    }

    fn identities(&self) -> Vec<String> {
        self.peer_certificate()
            .map_or_else(Vec::new, certificate_identities)
    }
}

impl MioStream for TlsStream {
    type Acceptor = Arc<ServerConfig>;

    fn accept(tcp: TcpStream, config: &Arc<ServerConfig>) -> io::Result<TlsStream> {
        TlsStream::new(tcp, Arc::clone(config))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use latchkey_client::tls::not_after_unix;

    #[test]
    fn malformed_certificates_have_no_identity() {
        for bytes in [&[][..], &[0x30, 0x85, 0, 0, 0, 0, 0], b"not a certificate"] {
            assert!(certificate_identities(bytes).is_empty());
        }
    }

    /// The client crate's DER walk reads the same end of validity as `x509-parser`, in both of
    /// RFC 5280's time forms (UTCTime before 2050, GeneralizedTime from 2050), with and without
    /// a version field's worth of extensions.
    #[test]
    fn the_expiry_read_is_x509_parsers() {
        let key = rcgen::KeyPair::generate().unwrap();
        let dates = [
            (1971, 1, 1),
            (1999, 12, 31),
            (2000, 2, 29),
            (2038, 1, 19),
            (2049, 12, 31),
            (2050, 1, 1),
            (2100, 6, 15),
            (4000, 2, 29),
        ];
        for (year, month, day) in dates {
            for names in [vec![], vec!["billing.example".to_string()]] {
                let mut params = rcgen::CertificateParams::new(names).unwrap();
                params.not_after = rcgen::date_time_ymd(year, month, day);
                let cert = params.self_signed(&key).unwrap();
                let der = cert.der().as_ref();
                let (_, parsed) = X509Certificate::from_der(der).unwrap();
                let expected = u64::try_from(parsed.validity().not_after.timestamp()).ok();
                assert_eq!(not_after_unix(der), expected, "{year}-{month}-{day}");
                assert!(expected.is_some());
            }
        }
    }
}
