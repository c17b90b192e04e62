//! Certificates made at test time (rcgen): a test CA, the certificates it signs (IP addresses
//! become IP SANs) and a server configuration with TLS on 127.0.0.1.

use super::server::test_config;
use latchkey::config::{Config, TlsConfig};
use rcgen::{BasicConstraints, Certificate, CertificateParams, DnType, IsCa, KeyPair};
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};

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
