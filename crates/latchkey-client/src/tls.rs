//! TLS for both ends: reading PEM certificates and keys and checking them, the client's rustls
//! configuration, and the non-blocking TLS stream ([`TlsStream`]) of the server's sessions and
//! of the client's.
//!
//! Every error names the configuration key (or command-line flag) and the path it is about, on
//! one line, e.g. `tls.key_file /etc/latchkey/server.key: does not match tls.cert_file ...`.
//! Files are read whole, at most [`PEM_FILE_BYTES_MAX`] each, once at start.
//!
//! The crypto provider is rustls's `ring` (no cmake or assembler needed to build). The expiry of
//! a certificate read from a file (rustls checks the validity of the peer's, not of ours) is
//! read by [`not_after_unix`], which walks the certificate's DER only as far as its validity.
//!
//! A client's configuration and the name it expects of the server make a [`Connector`], which
//! starts each connection: the official client's sessions, `latchkey stats` and `keys`, and
//! `latchkey bench` all connect through one.
//!
//! Not here: the server's configuration and a client certificate's identities (the server's
//! `tls` module, in the `latchkey` package).

use rustls::client::WebPkiServerVerifier;
use rustls::crypto::CryptoProvider;
use rustls::{ClientConfig, ClientConnection, RootCertStore, StreamOwned};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use std::io;
use std::net::{SocketAddr, TcpStream};
use std::path::Path;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};

mod stream;

pub use stream::{TlsError, TlsStream, READ_ROUNDS_MAX, TLS_BUFFER_BYTES};

/// The largest PEM file read (certificate chains and CA bundles are a few KiB).
pub const PEM_FILE_BYTES_MAX: u64 = 1 << 20;

/// The crypto provider of every configuration.
pub fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// An error about the file `path` named by `key`.
pub fn file_error(key: &str, path: &Path, cause: impl std::fmt::Display) -> io::Error {
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

/// The CA certificates in the PEM file `path`, as the roots a peer's certificate must chain to.
pub fn root_store(key: &str, path: &Path) -> io::Result<Arc<RootCertStore>> {
    let mut roots = RootCertStore::empty();
    for cert in load_certs(key, path)? {
        roots
            .add(cert)
            .map_err(|e| file_error(key, path, format!("not a usable CA certificate: {e}")))?;
    }
    Ok(Arc::new(roots))
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
///
/// Reads the DER only as far as it must (RFC 5280 §4.1): the certificate's `tbsCertificate`,
/// past its version, serial number, signature algorithm and issuer, to its `validity`, whose
/// `notAfter` is a UTCTime (`YYMMDDHHMMSSZ`, years 1950–2049) or a GeneralizedTime
/// (`YYYYMMDDHHMMSSZ`), the only forms RFC 5280 allows.
pub fn not_after_unix(cert: &[u8]) -> Option<u64> {
    let (certificate, _) = der_element(cert, DER_SEQUENCE)?;
    let (mut tbs, _) = der_element(certificate, DER_SEQUENCE)?;
    if tbs.first() == Some(&DER_VERSION) {
        tbs = der_element(tbs, DER_VERSION)?.1;
    }
    // The serial number, the signature algorithm, the issuer.
    for tag in [DER_INTEGER, DER_SEQUENCE, DER_SEQUENCE] {
        tbs = der_element(tbs, tag)?.1;
    }
    let (validity, _) = der_element(tbs, DER_SEQUENCE)?;
    let (_not_before, rest) = der_time(validity)?;
    let (not_after, _) = der_time(rest)?;
    u64::try_from(not_after).ok()
}

const DER_INTEGER: u8 = 0x02;
const DER_SEQUENCE: u8 = 0x30;
const DER_UTC_TIME: u8 = 0x17;
const DER_GENERALIZED_TIME: u8 = 0x18;
/// A certificate's `[0] EXPLICIT` version.
const DER_VERSION: u8 = 0xa0;

/// The content of the DER element with `tag` at the start of `bytes`, and what follows it.
fn der_element(bytes: &[u8], tag: u8) -> Option<(&[u8], &[u8])> {
    let (&first, rest) = bytes.split_first()?;
    let (&length_byte, rest) = rest.split_first()?;
    if first != tag {
        return None;
    }
    let (length, rest) = if length_byte < 0x80 {
        (usize::from(length_byte), rest)
    } else {
        // The long form: 1 to 4 length bytes (0x80, the indefinite form, is not DER).
        let count = usize::from(length_byte & 0x7f);
        if count == 0 || count > 4 || rest.len() < count {
            return None;
        }
        let (digits, rest) = rest.split_at(count);
        let length = digits
            .iter()
            .fold(0usize, |length, &digit| length << 8 | usize::from(digit));
        (length, rest)
    };
    (rest.len() >= length).then(|| rest.split_at(length))
}

/// The UTCTime or GeneralizedTime at the start of `bytes`, in seconds since the Unix epoch
/// (negative before it), and what follows it.
fn der_time(bytes: &[u8]) -> Option<(i64, &[u8])> {
    let (year, time, rest) = match *bytes.first()? {
        DER_UTC_TIME => {
            let (text, rest) = der_element(bytes, DER_UTC_TIME)?;
            let (year, time) = text.split_at_checked(2)?;
            let year = decimal(year)?;
            (
                if year < 50 { 2000 + year } else { 1900 + year },
                time,
                rest,
            )
        }
        DER_GENERALIZED_TIME => {
            let (text, rest) = der_element(bytes, DER_GENERALIZED_TIME)?;
            let (year, time) = text.split_at_checked(4)?;
            (decimal(year)?, time, rest)
        }
        _ => return None,
    };
    // MMDDHHMMSSZ
    if time.len() != 11 || time[10] != b'Z' {
        return None;
    }
    let [month, day, hour, minute, second] = [0, 2, 4, 6, 8].map(|at| decimal(&time[at..at + 2]));
    let (month, day, hour, minute, second) = (month?, day?, hour?, minute?, second?);
    let leap = year % 4 == 0 && (year % 100 != 0 || year % 400 == 0);
    let month_days = [
        31,
        if leap { 29 } else { 28 },
        31,
        30,
        31,
        30,
        31,
        31,
        30,
        31,
        30,
        31,
    ];
    if !(1..=12).contains(&month) || day == 0 || day > month_days[month as usize - 1] {
        return None;
    }
    if hour > 23 || minute > 59 || second > 59 {
        return None;
    }
    let days = days_from_civil(year, month, day);
    let seconds = days * 86_400 + hour * 3_600 + minute * 60 + second;
    Some((seconds, rest))
}

/// The decimal number written in ASCII `digits` (`None` if any is not a digit).
fn decimal(digits: &[u8]) -> Option<i64> {
    digits.iter().try_fold(0i64, |number, &digit| {
        digit
            .is_ascii_digit()
            .then(|| number * 10 + i64::from(digit - b'0'))
    })
}

/// Days from 1970-01-01 to the proleptic Gregorian date `year-month-day` (month 1..=12).
fn days_from_civil(year: i64, month: i64, day: i64) -> i64 {
    // Howard Hinnant's algorithm: years start in March, so the leap day ends a year.
    let year = if month <= 2 { year - 1 } else { year };
    let era = year.div_euclid(400);
    let year_of_era = year - era * 400;
    let month_from_march = (month + 9) % 12;
    let day_of_year = (153 * month_from_march + 2) / 5 + day - 1;
    let day_of_era = year_of_era * 365 + year_of_era / 4 - year_of_era / 100 + day_of_year;
    era * 146_097 + day_of_era - 719_468
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_certificates_have_no_expiry() {
        for bytes in [
            &[][..],
            &[0x30, 0x85, 0, 0, 0, 0, 0],
            &[0x30, 0x80, 0, 0],
            b"not a certificate",
        ] {
            assert_eq!(not_after_unix(bytes), None);
        }
    }

    #[test]
    fn days_from_civil_counts_from_the_epoch() {
        assert_eq!(days_from_civil(1970, 1, 1), 0);
        assert_eq!(days_from_civil(1969, 12, 31), -1);
        assert_eq!(days_from_civil(2000, 3, 1), 11_017);
        assert_eq!(days_from_civil(2024, 2, 29), 19_782);
    }

    #[test]
    fn times_in_both_forms_are_read_and_bad_ones_refused() {
        let time = |tag: u8, text: &str| {
            let mut bytes = vec![tag, text.len() as u8];
            bytes.extend_from_slice(text.as_bytes());
            der_time(&bytes).map(|(seconds, _)| seconds)
        };
        assert_eq!(time(DER_UTC_TIME, "700101000000Z"), Some(0));
        assert_eq!(time(DER_UTC_TIME, "491231235959Z"), Some(2_524_607_999));
        assert_eq!(time(DER_UTC_TIME, "500101000000Z"), Some(-631_152_000));
        assert_eq!(
            time(DER_GENERALIZED_TIME, "20500101000000Z"),
            Some(2_524_608_000)
        );
        assert_eq!(
            time(DER_GENERALIZED_TIME, "99991231235959Z"),
            Some(253_402_300_799)
        );
        for bad in [
            "700101000000",
            "701301000000Z",
            "700230000000Z",
            "700101240000Z",
            "7001010000+0Z",
        ] {
            assert_eq!(time(DER_UTC_TIME, bad), None, "{bad}");
        }
        assert_eq!(time(DER_SEQUENCE, "700101000000Z"), None);
    }
}
