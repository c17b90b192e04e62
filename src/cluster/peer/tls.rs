//! TLS between members (`[cluster.tls]`): the peer TLS configurations, the rule that binds a
//! member's id to its certificate, and a peer connection's stream (plain TCP or TLS).
//!
//! With `[cluster.tls]` every peer connection is TLS both ways (mutual): the dialer presents
//! its certificate and checks the reader's against `ca_file` for the DNS name of the member it
//! dialed ([`member_name`]: `member-N`); the reader requires a client certificate signed by a
//! CA in `ca_file` (rustls's `WebPkiClientVerifier`) and, once the hello says who dials, that
//! the certificate names that member ([`check_member`], the one home of the rule). TLS is below
//! the hello: the frames and their versions are the same with and without it.
//!
//! Invariants: a member with `[cluster.tls]` reads and writes its peer connections only through
//! rustls (a [`PeerStream::Tls`] from [`PeerTls::dial`] or [`PeerTls::accept`]), so it never
//! sends a raft message in plaintext; a member's own certificate names it and chains to its
//! `ca_file`, checked at start ([`PeerTls::load`]), so a misconfigured member exits rather than
//! being refused by every peer. A TLS stream is owned with its socket: the dialer's by its
//! lane (under its lock, as the plain socket is), the reader's by its connection.
//!
//! Every file is read once at start ([`latchkey_client::tls`]'s readers: each error names the
//! key and the path). Rotation is a rolling restart with new files; `ca_file` may hold the old
//! CA and the new one while the members move over. Deliberately not here: hot reload, session
//! resumption (connections are long-lived), certificate revocation, and the handshake deadline
//! (the hello's: `PeerLimits::hello_timeout` bounds a handshake and its hello together).

use crate::config::PeerTlsConfig;
use crate::server::tls::certificate_dns_names;
use latchkey_client::tls::{
    file_error, load_certs, load_key, provider, root_store, TlsError, TlsStream,
};
use mio::net::TcpStream;
use mio::{Interest, Registry, Token};
use rustls::client::danger::ServerCertVerifier;
use rustls::client::{Resumption, WebPkiServerVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::server::danger::ClientCertVerifier;
use rustls::server::WebPkiClientVerifier;
use rustls::{ClientConfig, ClientConnection, ServerConfig};
use std::fmt;
use std::io::{self, IoSlice, Read, Write};
use std::sync::Arc;

/// The DNS name a member's certificate carries, and a dialer checks: `member-N`.
pub fn member_name(node_id: u64) -> String {
    format!("member-{node_id}")
}

/// Checks that the certificate `cert` (DER, the end entity; `None`: none presented) names
/// member `node_id` as a DNS SAN ([`member_name`]): the one place the binding of a member's id
/// to its certificate is checked. `Err` says why, naming what the certificate names instead.
pub fn check_member(cert: Option<&[u8]>, node_id: u64) -> Result<(), String> {
    let Some(cert) = cert else {
        return Err("no certificate presented".to_string());
    };
    let expected = member_name(node_id);
    let names = certificate_dns_names(cert);
    if names
        .iter()
        .any(|name| name.eq_ignore_ascii_case(&expected))
    {
        return Ok(());
    }
    let named = match names.is_empty() {
        true => "no DNS name".to_string(),
        false => names.join(", "),
    };
    Err(format!(
        "its certificate does not name member {node_id} (DNS SAN {expected}); it names {named}"
    ))
}

/// A member's peer TLS: its client configuration (to dial) and its server configuration (to
/// accept), built once at start from `[cluster.tls]`.
#[derive(Clone)]
pub struct PeerTls {
    client: Arc<ClientConfig>,
    server: Arc<ServerConfig>,
}

impl fmt::Debug for PeerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("PeerTls { .. }")
    }
}

const CERT_KEY: &str = "cluster.tls.cert_file";
const KEY_KEY: &str = "cluster.tls.key_file";
const CA_KEY: &str = "cluster.tls.ca_file";

impl PeerTls {
    /// Reads and checks the files of member `node_id`: the certificate (not expired, naming
    /// the member, chaining to `ca_file` for both ends' uses), the key (fitting the
    /// certificate), the CAs. Every error names the key and the path.
    pub fn load(files: &PeerTlsConfig, node_id: u64) -> io::Result<PeerTls> {
        let certs = load_certs(CERT_KEY, &files.cert_file)?;
        let cert_error = |cause: String| file_error(CERT_KEY, &files.cert_file, cause);
        check_member(Some(certs[0].as_ref()), node_id).map_err(|why| {
            cert_error(format!(
                "must name this member (cluster.node_id {node_id}): {}",
                why.trim_start_matches("its ")
            ))
        })?;
        let key = load_key(KEY_KEY, &files.key_file)?;
        let roots = root_store(CA_KEY, &files.ca_file)?;
        let provider = provider();
        let ca_error =
            |cause: rustls::server::VerifierBuilderError| file_error(CA_KEY, &files.ca_file, cause);
        let client_verifier =
            WebPkiClientVerifier::builder_with_provider(Arc::clone(&roots), Arc::clone(&provider))
                .build()
                .map_err(ca_error)?;
        let server_verifier =
            WebPkiServerVerifier::builder_with_provider(roots, Arc::clone(&provider))
                .build()
                .map_err(ca_error)?;
        check_own(&certs, node_id, &*client_verifier, &*server_verifier)
            .map_err(|why| cert_error(format!("{why} (is it signed by a CA in {CA_KEY}?)")))?;
        let key_error = |e: rustls::Error| {
            let cause = format!("does not fit {CERT_KEY} {}: {e}", files.cert_file.display());
            file_error(KEY_KEY, &files.key_file, cause)
        };
        let mut server = ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(io::Error::other)?
            .with_client_cert_verifier(client_verifier)
            .with_single_cert(certs.clone(), key.clone_key())
            .map_err(key_error)?;
        // Peer connections live long: no resumption, so no tickets to write or keep.
        server.send_tls13_tickets = 0;
        let mut client = ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(io::Error::other)?
            .with_webpki_verifier(server_verifier)
            .with_client_auth_cert(certs, key)
            .map_err(key_error)?;
        client.resumption = Resumption::disabled();
        Ok(PeerTls {
            client: Arc::new(client),
            server: Arc::new(server),
        })
    }

    /// The TLS stream of a connection this member dials to member `to` (perhaps still
    /// connecting): its handshake checks that the reader's certificate names `to`.
    pub(crate) fn dial(&self, tcp: TcpStream, to: u64) -> io::Result<TlsStream> {
        let name = ServerName::try_from(member_name(to)).map_err(io::Error::other)?;
        let tls =
            ClientConnection::new(Arc::clone(&self.client), name).map_err(io::Error::other)?;
        Ok(TlsStream::client(tcp, tls))
    }

    /// The TLS stream of a connection this member accepted: its handshake requires a
    /// certificate signed by a CA in `ca_file` ([`check_member`] checks the name at the hello).
    pub(crate) fn accept(&self, tcp: TcpStream) -> io::Result<TlsStream> {
        TlsStream::new(tcp, Arc::clone(&self.server))
    }
}

/// Checks this member's own chain as its peers will: as a server certificate for its
/// [`member_name`], and as a client certificate.
fn check_own(
    certs: &[CertificateDer<'static>],
    node_id: u64,
    client_verifier: &dyn ClientCertVerifier,
    server_verifier: &dyn ServerCertVerifier,
) -> Result<(), String> {
    let (end_entity, intermediates) = certs.split_first().ok_or("no certificate")?;
    let now = UnixTime::now();
    let name = ServerName::try_from(member_name(node_id)).map_err(|e| e.to_string())?;
    server_verifier
        .verify_server_cert(end_entity, intermediates, &name, &[], now)
        .map_err(|e| format!("peers would refuse it as a server certificate: {e}"))?;
    client_verifier
        .verify_client_cert(end_entity, intermediates, now)
        .map_err(|e| format!("peers would refuse it as a client certificate: {e}"))?;
    Ok(())
}

/// A peer connection's bytes: plain TCP, or TLS over it (see the module docs).
pub(crate) enum PeerStream {
    /// No `[cluster.tls]`.
    Plain(TcpStream),
    /// `[cluster.tls]`: every byte goes through rustls.
    Tls(Box<TlsStream>),
}

impl PeerStream {
    /// Whether rustls holds records the socket did not take yet (a flush writes them).
    pub(crate) fn wants_write(&self) -> bool {
        match self {
            PeerStream::Plain(_) => false,
            PeerStream::Tls(tls) => tls.wants_write(),
        }
    }

    /// Whether a TLS handshake is under way.
    pub(crate) fn handshaking(&self) -> bool {
        match self {
            PeerStream::Plain(_) => false,
            PeerStream::Tls(tls) => tls.handshaking(),
        }
    }

    /// Whether this is a TLS stream.
    pub(crate) fn is_tls(&self) -> bool {
        matches!(self, PeerStream::Tls(_))
    }

    /// The certificate the dialer presented, on an accepted TLS stream whose handshake is done.
    pub(crate) fn peer_certificate(&self) -> Option<&[u8]> {
        match self {
            PeerStream::Plain(_) => None,
            PeerStream::Tls(tls) => tls.peer_certificate(),
        }
    }

    /// The TCP socket (to peek at, set options).
    pub(crate) fn tcp(&self) -> &TcpStream {
        match self {
            PeerStream::Plain(tcp) => tcp,
            PeerStream::Tls(tls) => tls.tcp(),
        }
    }
}

/// Who ended a connection with a TLS failure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum TlsFailure {
    /// The other side, with an alert: it refused this member's certificate (or handshake).
    ByPeer,
    /// This member: the other side's certificate failed its checks, or its bytes are not TLS.
    ByThisMember,
}

/// Whether `error` is a TLS failure (a refused certificate, an alert, garbage), and whose;
/// `None`: a socket's error.
pub(crate) fn tls_failure(error: &io::Error) -> Option<TlsFailure> {
    let inner = error.get_ref()?;
    let TlsError(error) = inner.downcast_ref::<TlsError>()?;
    Some(match error {
        rustls::Error::AlertReceived(_) => TlsFailure::ByPeer,
        _ => TlsFailure::ByThisMember,
    })
}

impl Read for PeerStream {
    fn read(&mut self, buffer: &mut [u8]) -> io::Result<usize> {
        match self {
            PeerStream::Plain(tcp) => tcp.read(buffer),
            PeerStream::Tls(tls) => tls.read(buffer),
        }
    }
}

impl Write for PeerStream {
    fn write(&mut self, bytes: &[u8]) -> io::Result<usize> {
        match self {
            PeerStream::Plain(tcp) => tcp.write(bytes),
            PeerStream::Tls(tls) => tls.write(bytes),
        }
    }

    fn write_vectored(&mut self, slices: &[IoSlice<'_>]) -> io::Result<usize> {
        match self {
            PeerStream::Plain(tcp) => tcp.write_vectored(slices),
            // rustls takes one slice at a time: the first that is not empty.
            PeerStream::Tls(tls) => {
                let first = slices.iter().find(|slice| !slice.is_empty());
                tls.write(first.map_or(&[][..], |slice| &slice[..]))
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        match self {
            PeerStream::Plain(tcp) => tcp.flush(),
            PeerStream::Tls(tls) => tls.flush(),
        }
    }
}

impl mio::event::Source for PeerStream {
    fn register(
        &mut self,
        registry: &Registry,
        token: Token,
        interest: Interest,
    ) -> io::Result<()> {
        match self {
            PeerStream::Plain(tcp) => tcp.register(registry, token, interest),
            PeerStream::Tls(tls) => tls.register(registry, token, interest),
        }
    }

    fn reregister(
        &mut self,
        registry: &Registry,
        token: Token,
        interest: Interest,
    ) -> io::Result<()> {
        match self {
            PeerStream::Plain(tcp) => tcp.reregister(registry, token, interest),
            PeerStream::Tls(tls) => tls.reregister(registry, token, interest),
        }
    }

    fn deregister(&mut self, registry: &Registry) -> io::Result<()> {
        match self {
            PeerStream::Plain(tcp) => tcp.deregister(registry),
            PeerStream::Tls(tls) => tls.deregister(registry),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A self-signed certificate with common name `cn` and DNS SANs `names` (DER).
    fn certificate(cn: &str, names: &[&str]) -> Vec<u8> {
        let key = rcgen::KeyPair::generate().unwrap();
        let names = names
            .iter()
            .map(|name| name.to_string())
            .collect::<Vec<_>>();
        let mut params = rcgen::CertificateParams::new(names).unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, cn);
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn a_member_is_named_by_a_dns_san_alone() {
        let two = certificate("anything", &["peer.example", "member-2"]);
        assert_eq!(check_member(Some(&two), 2), Ok(()));
        let refused = check_member(Some(&two), 3).unwrap_err();
        assert!(
            refused.contains("does not name member 3 (DNS SAN member-3)"),
            "{refused}"
        );
        assert!(refused.contains("peer.example, member-2"), "{refused}");
        // A common name is not a member name (nor is a prefix, or another number's).
        let common_name = certificate("member-2", &[]);
        assert!(check_member(Some(&common_name), 2)
            .unwrap_err()
            .contains("no DNS name"));
        let near = certificate("x", &["member-21", "member-2.example"]);
        assert!(check_member(Some(&near), 2).is_err());
        assert!(check_member(None, 2)
            .unwrap_err()
            .contains("no certificate"));
        assert!(check_member(Some(b"not a certificate"), 2).is_err());
    }
}
