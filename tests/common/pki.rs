//! A test PKI made at test time with rcgen (a CA, server and client certificates, expired
//! ones), and TLS connections to a server under test: raw rustls streams and official clients.

use super::server::test_config;
use latchkey::config::{Config, TlsConfig};
use latchkey_client::tls::ClientFiles;
use latchkey_client::{Client, ClientConfig, ClientTls};
use rcgen::{BasicConstraints, Certificate, CertificateParams, DnType, IsCa, KeyPair};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A test CA and the files it signs, in a directory of their own (removed on drop).
pub struct Pki {
    /// The directory of the files.
    pub dir: PathBuf,
    ca: Certificate,
    ca_key: KeyPair,
}

impl Pki {
    pub fn new(name: &str) -> Pki {
        static COUNT: AtomicU64 = AtomicU64::new(0);
        let count = COUNT.fetch_add(1, Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!(
            "latchkey-tls-{}-{name}-{count}",
            std::process::id()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let ca_key = KeyPair::generate().unwrap();
        let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(DnType::CommonName, format!("latchkey test CA {name}"));
        let ca = params.self_signed(&ca_key).unwrap();
        let pki = Pki { dir, ca, ca_key };
        pki.write("ca.crt", &pki.ca.pem());
        pki
    }

    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.dir.join(name);
        std::fs::write(&path, text).unwrap();
        path
    }

    pub fn ca_file(&self) -> PathBuf {
        self.dir.join("ca.crt")
    }

    /// A certificate for `names` (IP addresses become IP SANs) with common name `cn`, signed
    /// by the CA: its certificate and key files.
    pub fn leaf(&self, file: &str, cn: &str, names: &[&str]) -> (PathBuf, PathBuf) {
        self.leaf_with(file, cn, names, |_| {})
    }

    pub fn leaf_with(
        &self,
        file: &str,
        cn: &str,
        names: &[&str],
        edit: impl FnOnce(&mut CertificateParams),
    ) -> (PathBuf, PathBuf) {
        let key = KeyPair::generate().unwrap();
        let names: Vec<String> = names.iter().map(|name| name.to_string()).collect();
        let mut params = CertificateParams::new(names).unwrap();
        params.distinguished_name.push(DnType::CommonName, cn);
        edit(&mut params);
        let cert = params.signed_by(&key, &self.ca, &self.ca_key).unwrap();
        let cert_file = self.write(&format!("{file}.crt"), &cert.pem());
        let key_file = self.write(&format!("{file}.key"), &key.serialize_pem());
        (cert_file, key_file)
    }

    /// A server config with TLS on 127.0.0.1.
    pub fn server_config(&self, client_ca: bool) -> Config {
        let (cert_file, key_file) = self.leaf("server", "latchkey server", &["127.0.0.1"]);
        let mut config = test_config(2);
        config.tls = Some(TlsConfig {
            cert_file,
            key_file,
            client_ca_file: client_ca.then(|| self.ca_file()),
        });
        config
    }
}

impl Drop for Pki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// The client's TLS files: the CA to trust and, if any, the certificate and key to present.
pub fn client_files(ca: &Path, cert: Option<(&Path, &Path)>) -> ClientFiles {
    ClientFiles {
        ca_file: ca.to_path_buf(),
        cert_and_key: cert.map(|(c, k)| (c.to_path_buf(), k.to_path_buf())),
    }
}

/// One admin request `GET path` over a raw TLS connection with `config`: the whole answer as
/// text. The server closes after the answer, perhaps with no close_notify reaching us first,
/// so the read's ending error is ignored.
pub fn https_get(addr: SocketAddr, config: Arc<rustls::ClientConfig>, path: &str) -> String {
    let mut stream = raw_connect(addr, config);
    let request = format!("GET {path} HTTP/1.1\r\nHost: latchkey\r\n\r\n");
    stream.write_all(request.as_bytes()).unwrap();
    let mut answer = Vec::new();
    let _ = stream.read_to_end(&mut answer);
    String::from_utf8_lossy(&answer).into_owned()
}

/// A rustls client config trusting `ca` (and presenting `cert`, if any).
pub fn raw_client_config(ca: &Path, cert: Option<(&Path, &Path)>) -> Arc<rustls::ClientConfig> {
    latchkey_client::tls::client_config(&client_files(ca, cert)).unwrap()
}

/// A rustls client config trusting `ca` and presenting `cert` as it is: unlike the official
/// client's loader, which refuses an expired certificate.
pub fn presenting_config(ca: &Path, cert: &(PathBuf, PathBuf)) -> Arc<rustls::ClientConfig> {
    let mut roots = rustls::RootCertStore::empty();
    roots
        .add(CertificateDer::from_pem_file(ca).unwrap())
        .unwrap();
    let chain = vec![CertificateDer::from_pem_file(&cert.0).unwrap()];
    let key = PrivateKeyDer::from_pem_file(&cert.1).unwrap();
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let config = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_client_auth_cert(chain, key)
        .unwrap();
    Arc::new(config)
}

/// A whole ClientHello, as a client with `config` sends it first (to 127.0.0.1).
pub fn client_hello(config: &Arc<rustls::ClientConfig>) -> Vec<u8> {
    let name = "127.0.0.1".try_into().unwrap();
    let mut tls = rustls::ClientConnection::new(Arc::clone(config), name).unwrap();
    let mut hello = Vec::new();
    while tls.wants_write() {
        tls.write_tls(&mut hello).unwrap();
    }
    hello
}

/// A blocking TLS connection to `addr` (name 127.0.0.1), with read and write timeouts.
pub fn raw_connect(
    addr: SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> rustls::StreamOwned<rustls::ClientConnection, TcpStream> {
    let tcp = TcpStream::connect(addr).unwrap();
    tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    tcp.set_write_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let name = "127.0.0.1".try_into().unwrap();
    let connection = rustls::ClientConnection::new(config, name).unwrap();
    rustls::StreamOwned::new(connection, tcp)
}

/// A client of `addr` over TLS with these files (one session, short timeouts).
pub fn tls_client(addr: SocketAddr, ca: &Path, cert: Option<(&Path, &Path)>) -> Client {
    try_tls_client(addr, ca, cert).expect("client")
}

/// Like [`tls_client`], or the error that refused the files.
pub fn try_tls_client(
    addr: SocketAddr,
    ca: &Path,
    cert: Option<(&Path, &Path)>,
) -> std::io::Result<Client> {
    let files = client_files(ca, cert);
    let config = ClientConfig {
        addrs: vec![addr],
        sessions: 1,
        connect_timeout: Duration::from_secs(2),
        transport_timeout: Duration::from_secs(2),
        tls: Some(ClientTls {
            files,
            server_name: None,
        }),
        ..ClientConfig::default()
    };
    Client::with_config(config)
}

/// A TLS connection on a non-blocking socket with small buffers, driven by hand: a client that
/// can stop reading (and whose unread answers back up into the server soon).
pub struct HandDriven {
    pub tcp: TcpStream,
    pub tls: rustls::ClientConnection,
}

impl HandDriven {
    /// Connects to `addr` (name 127.0.0.1) with 4 KiB socket buffers and completes the
    /// handshake (blocking), then turns non-blocking.
    pub fn connect(addr: SocketAddr, config: &Arc<rustls::ClientConfig>) -> HandDriven {
        let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None);
        let socket = socket.unwrap();
        socket.set_recv_buffer_size(4096).unwrap();
        socket.set_send_buffer_size(4096).unwrap();
        socket.connect(&addr.into()).unwrap();
        let mut tcp: TcpStream = socket.into();
        tcp.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        let name = "127.0.0.1".try_into().unwrap();
        let mut tls = rustls::ClientConnection::new(Arc::clone(config), name).unwrap();
        while tls.is_handshaking() {
            tls.complete_io(&mut tcp).unwrap();
        }
        tcp.set_nonblocking(true).unwrap();
        HandDriven { tcp, tls }
    }

    /// Hands rustls what of `plaintext` its buffer takes and writes records until the socket
    /// would block: how much plaintext it took.
    pub fn push(&mut self, plaintext: &[u8]) -> usize {
        let taken = self.tls.writer().write(plaintext).unwrap();
        while self.tls.wants_write() {
            match self.tls.write_tls(&mut self.tcp) {
                Ok(_) => {}
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => panic!("write: {e}"),
            }
        }
        taken
    }

    /// Reads what the socket has (a bounded number of records), appending the plaintext.
    pub fn pull(&mut self, plaintext: &mut Vec<u8>) {
        for _ in 0..64 {
            // WouldBlock once rustls has no more plaintext; what it had is appended.
            let _ = self.tls.reader().read_to_end(plaintext);
            match self.tls.read_tls(&mut self.tcp) {
                Ok(0) => panic!("the server closed"),
                Ok(_) => {
                    self.tls.process_new_packets().expect("valid TLS");
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => break,
                Err(e) => panic!("read: {e}"),
            }
        }
        let _ = self.tls.reader().read_to_end(plaintext);
    }
}
