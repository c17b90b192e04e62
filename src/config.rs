//! The configuration file: defaults, parsing and validation.
//!
//! The file is TOML with seven sections, `[server]`, `[limits]`, `[timer]`, `[tokens]`, `[log]`,
//! `[tls]` and `[[auth.rule]]`; `config.example.toml` at the repository root documents every key
//! and sets it to its default (`[tls]` and the rules, off by default, are there commented out). Every section and every key
//! is optional: whatever the file leaves out keeps its default, so an empty file is a valid
//! configuration.
//!
//! Invariants of a [`Config`] returned by this module (callers may rely on them without
//! re-checking): every value is inside the range documented on its field; `server.cores` is a
//! resolved count in `1..=CORES_MAX` (never the file's `0`); a single node has
//! `limits.max_keys >= server.cores`, so every partition gets at least one key entry. With
//! `[cluster]` (see [`Config::check_cluster_mode`]): `cluster.shards <= limits.max_keys <=
//! cluster.shards × HOLDS_MAX`, no setting that cluster mode would ignore is set
//! (`tokens.state_dir`, a `timer.tick_ms` other than 1, a `tokens.reservation` other than its
//! default), and, after [`Config::with_overrides`], `server.cores` was given explicitly.
//!
//! Every error names what it is about as `section.key` (or the unknown section or key), with the
//! line it is on when it comes from the file and the path when it comes from [`Config::load`],
//! on one line, e.g. `latchkey.toml:7: limits.max_waiters_per_key: must be at least 1, got 0`.
//! An unknown section or key is an error rather than a warning, so that a typo cannot silently
//! leave a limit at its default.
//!
//! Deliberately not here: the command line itself (see `main.rs`, which hands its `--listen`
//! and `--cores` to [`Config::with_overrides`]), building the logger from `[log]` and the
//! `RUST_LOG` override of `[log] level` (see [`crate::logging`]), and reading or writing
//! `tokens.state_dir` (the `tokens` module), and reading the `[tls]` files: the server reads
//! and checks them when it starts (`server::tls::server_config`), so that a configuration
//! built in code is checked the same way as one read from a file.

use std::collections::BTreeMap;
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::num::NonZeroUsize;
use std::path::{Path, PathBuf};

use log::LevelFilter;
use toml::{Spanned, Value};

use latchkey_client::protocol::KEY_BYTES_MAX;

/// The most cores (partitions) a server may run.
pub const CORES_MAX: usize = 1024;
/// The most sessions `limits.max_connections` may allow.
pub const CONNECTIONS_MAX: usize = 1_000_000;
/// The most waiters `limits.max_waiters_per_key` may allow on one key.
pub const WAITERS_PER_KEY_MAX: u32 = 1_000_000;
/// The most queued acquires `limits.max_pending_per_session` may allow one session.
pub const PENDING_PER_SESSION_MAX: u32 = 1_000_000;
/// The coarsest timer tick `timer.tick_ms` may ask for, in milliseconds.
pub const TICK_MS_MAX: u32 = 1000;

const LISTEN_DEFAULT: SocketAddr = SocketAddr::new(IpAddr::V4(Ipv4Addr::LOCALHOST), 7420);
const CONNECTIONS_DEFAULT: usize = 10_000;
const KEYS_DEFAULT: usize = 4_000_000;
const WAITERS_PER_KEY_DEFAULT: u32 = 1024;
const PENDING_PER_SESSION_DEFAULT: u32 = 1024;
const KEY_BYTES_DEFAULT: usize = KEY_BYTES_MAX;
const TICK_MS_DEFAULT: u32 = 1;
const RESERVATION_DEFAULT: u64 = 1 << 24;
/// The fewest tokens `tokens.reservation` may reserve at once.
pub const RESERVATION_MIN: u64 = 64;
/// The most tokens `tokens.reservation` may reserve at once.
pub const RESERVATION_MAX: u64 = 1 << 40;

// The defaults must pass the same validation as a file does.
const _: () = assert!(CONNECTIONS_DEFAULT >= 1 && CONNECTIONS_DEFAULT <= CONNECTIONS_MAX);
const _: () = assert!(
    KEYS_DEFAULT >= CORES_MAX,
    "every partition gets a key by default"
);
const _: () =
    assert!(WAITERS_PER_KEY_DEFAULT >= 1 && WAITERS_PER_KEY_DEFAULT <= WAITERS_PER_KEY_MAX);
const _: () = assert!(
    PENDING_PER_SESSION_DEFAULT >= 1 && PENDING_PER_SESSION_DEFAULT <= PENDING_PER_SESSION_MAX
);
const _: () = assert!(KEY_BYTES_DEFAULT >= 1 && KEY_BYTES_DEFAULT <= KEY_BYTES_MAX);
const _: () = assert!(TICK_MS_DEFAULT >= 1 && TICK_MS_DEFAULT <= TICK_MS_MAX);
const _: () =
    assert!(RESERVATION_DEFAULT >= RESERVATION_MIN && RESERVATION_DEFAULT <= RESERVATION_MAX);

/// The sections of the file and the keys each accepts, in the order the example file lists them.
const SECTIONS: [(&str, &[&str]); 8] = [
    ("server", &["listen", "cores", "health_listen"]),
    (
        "limits",
        &[
            "max_connections",
            "max_keys",
            "max_waiters_per_key",
            "max_pending_per_session",
            "max_key_bytes",
        ],
    ),
    ("timer", &["tick_ms"]),
    ("tokens", &["state_dir", "reservation"]),
    ("log", &["level", "format"]),
    ("tls", &["cert_file", "key_file", "client_ca_file"]),
    ("auth", &["rule"]),
    (
        "cluster",
        &[
            "node_id",
            "data_dir",
            "members",
            "shards",
            "fsync",
            "restore_from",
            "tls",
        ],
    ),
];

/// The whole server configuration: the file's sections, validated, with defaults filled in.
/// [`Config::default`] is what an empty file gives.
#[derive(Clone, Debug, PartialEq, Default)]
pub struct Config {
    /// `[server]`: where to listen and how many cores to run.
    pub server: ServerConfig,
    /// `[limits]`: the capacity bounds of docs/protocol.md §2–3.
    pub limits: LimitsConfig,
    /// `[timer]`: the resolution of waits and leases.
    pub timer: TimerConfig,
    /// `[tokens]`: where the token high-water mark persists.
    pub tokens: TokensConfig,
    /// `[log]`: the default log level and the format of log lines.
    pub log: LogConfig,
    /// `[tls]`: with it the lock port speaks only TLS; `None` (no section, the default) is
    /// plaintext.
    pub tls: Option<TlsConfig>,
    /// `[[auth.rule]]`: the key prefixes each client identity may use; empty (the default):
    /// every session may use every key.
    pub auth_rules: Vec<AuthRule>,
    /// `[cluster]`: with it this server is one member of a replicated cluster; `None` (no
    /// section, the default) is a single node.
    pub cluster: Option<ClusterConfig>,
}

/// `[server]`.
#[derive(Clone, Debug, PartialEq)]
pub struct ServerConfig {
    /// The address to accept sessions on. Default `127.0.0.1:7420`.
    pub listen: SocketAddr,
    /// How many cores (partitions, event loops) to run, resolved: `1..=CORES_MAX`. The file's
    /// `0` (the default) becomes one per CPU, capped at [`CORES_MAX`].
    pub cores: usize,
    /// Whether `cores` is a count the file or `--cores` gave (not `0`, not left out). Cluster
    /// mode requires one: its data directory records the core count.
    pub cores_explicit: bool,
    /// `server.health_listen`: a plaintext port that answers only `/health`, for probes that
    /// cannot present a client certificate. `None` (`""`, the default): no such port.
    pub health_listen: Option<SocketAddr>,
}

/// `[limits]`.
#[derive(Clone, Debug, PartialEq)]
pub struct LimitsConfig {
    /// Open sessions at most; one more gets `X` code 7. `1..=CONNECTIONS_MAX`, default 10 000.
    pub max_connections: usize,
    /// Key entries (held keys) at most, across the server; each partition enforces
    /// `max_keys / cores` (a cluster member: each shard it leads, `max_keys / shards`). At least
    /// `cores` (a cluster: `shards`), default 4 000 000 (a cluster's file that leaves it out:
    /// at most `shards × HOLDS_MAX`).
    pub max_keys: usize,
    /// Queued acquires per key at most; one more gets `B`. `1..=WAITERS_PER_KEY_MAX`,
    /// default 1024.
    pub max_waiters_per_key: u32,
    /// Acquires one session may have queued, across all partitions; one more that would
    /// queue gets `B`. `1..=PENDING_PER_SESSION_MAX`, default 1024.
    pub max_pending_per_session: u32,
    /// The longest key accepted, in bytes; `1..=KEY_BYTES_MAX`, default 1024.
    pub max_key_bytes: usize,
}

/// `[timer]`.
#[derive(Clone, Debug, PartialEq)]
pub struct TimerConfig {
    /// The timer resolution in milliseconds: waits and leases fire never early and at most one
    /// tick late. `1..=TICK_MS_MAX`, default 1.
    pub tick_ms: u32,
}

/// `[tokens]`.
#[derive(Clone, Debug, PartialEq)]
pub struct TokensConfig {
    /// The directory holding the persisted token high-water mark, or `None` (the file's `""`,
    /// the default) to rely on the wall clock alone.
    pub state_dir: Option<PathBuf>,
    /// Tokens a partition reserves with one persisted write (with a `state_dir`): fewer means
    /// more writes, more means a larger jump of the tokens after a crash.
    /// `RESERVATION_MIN..=RESERVATION_MAX`, default 2^24.
    pub reservation: u64,
}

impl Default for TokensConfig {
    fn default() -> TokensConfig {
        TokensConfig {
            state_dir: None,
            reservation: RESERVATION_DEFAULT,
        }
    }
}

/// `[log]`.
#[derive(Clone, Debug, PartialEq)]
pub struct LogConfig {
    /// The log level when `RUST_LOG` is not set. Default `info`.
    pub level: LevelFilter,
    /// How each log line is written. Default [`LogFormat::Text`].
    pub format: LogFormat,
}

/// `log.format`: how the server writes its log lines (to stderr).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum LogFormat {
    /// `"text"`: env_logger's lines for people, `[time LEVEL target] message`.
    #[default]
    Text,
    /// `"json"`: one JSON object a line (`ts`, `level`, `target`, `msg`), for log shippers.
    Json,
}

impl Default for ServerConfig {
    /// Listen on `127.0.0.1:7420`, one core per CPU.
    fn default() -> ServerConfig {
        ServerConfig {
            listen: LISTEN_DEFAULT,
            cores: cores_resolved(0),
            cores_explicit: false,
            health_listen: None,
        }
    }
}

impl Default for LimitsConfig {
    fn default() -> LimitsConfig {
        LimitsConfig {
            max_connections: CONNECTIONS_DEFAULT,
            max_keys: KEYS_DEFAULT,
            max_waiters_per_key: WAITERS_PER_KEY_DEFAULT,
            max_pending_per_session: PENDING_PER_SESSION_DEFAULT,
            max_key_bytes: KEY_BYTES_DEFAULT,
        }
    }
}

impl Default for TimerConfig {
    fn default() -> TimerConfig {
        TimerConfig {
            tick_ms: TICK_MS_DEFAULT,
        }
    }
}

impl Default for LogConfig {
    fn default() -> LogConfig {
        LogConfig {
            level: LevelFilter::Info,
            format: LogFormat::Text,
        }
    }
}

impl Config {
    /// Parses and validates a configuration from TOML text; what the text omits is default.
    pub fn from_toml_str(text: &str) -> Result<Config, ConfigError> {
        let mut config = Config::default();
        let mut listen = None;
        let mut max_keys_set = false;
        for (section, entries) in read_sections(text)? {
            if section == "tls" {
                // An empty `[tls]` still asks for TLS (and is refused below for its missing
                // files), rather than silently serving plaintext.
                config.tls.get_or_insert_with(TlsConfig::default);
            }
            if section == "cluster" {
                config.cluster.get_or_insert_with(ClusterConfig::default);
            }
            for (key, value) in entries {
                let setting = Setting {
                    section: &section,
                    key: key.get_ref(),
                    line: line_column(text, key.span().start).0,
                    value: &value,
                };
                config.apply(&setting)?;
                if (setting.section, setting.key) == ("server", "listen") {
                    listen = Some(config.server.listen);
                }
                max_keys_set |= (setting.section, setting.key) == ("limits", "max_keys");
            }
        }
        if let (Some(cluster), false) = (&config.cluster, max_keys_set) {
            // Left out, max_keys is what the shards can hold if that is below its default; set,
            // it is checked against that (see `check_cluster_mode`).
            let holds_max = cluster::holds_max(cluster.shards);
            config.limits.max_keys = config.limits.max_keys.min(holds_max);
        }
        config.check_relations()?;
        config.take_member_address(listen)?;
        Ok(config)
    }

    /// Reads and validates the file at `path`. Every error names the path.
    pub fn load(path: &Path) -> Result<Config, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|error| ConfigError {
            path: Some(path.to_path_buf()),
            line: None,
            column: None,
            key: None,
            message: format!("cannot read the config file: {error}"),
        })?;
        Config::from_toml_str(&text).map_err(|error| ConfigError {
            path: Some(path.to_path_buf()),
            ..error
        })
    }

    /// Applies the command line's `--listen` and `--cores` over the file's values. `cores` is
    /// validated as `server.cores` is in the file: 0 means one per CPU (which a cluster member
    /// refuses), at most [`CORES_MAX`].
    pub fn with_overrides(
        mut self,
        listen: Option<SocketAddr>,
        cores: Option<usize>,
    ) -> Result<Config, ConfigError> {
        if let Some(listen) = listen {
            self.server.listen = listen;
        }
        if let Some(cores) = cores {
            if cores > CORES_MAX {
                let message =
                    format!("server.cores (--cores): must be at most {CORES_MAX}, got {cores}");
                return Err(ConfigError::new("server.cores", None, message));
            }
            self.server.cores = cores_resolved(cores);
            self.server.cores_explicit = cores > 0;
        }
        self.check_relations()?;
        self.take_member_address(listen)?;
        // Only now: the file may leave the count to the command line.
        self.check_cluster_mode()?;
        Ok(self)
    }

    /// In cluster mode, checks the cluster's relations and what cluster mode asks of the other
    /// sections, and listens on this member's client address; `listen` is the address the file
    /// or the command line set, if either did.
    fn take_member_address(&mut self, listen: Option<SocketAddr>) -> Result<(), ConfigError> {
        let Some(cluster) = &self.cluster else {
            return Ok(());
        };
        cluster.check(listen)?;
        cluster::check_mode(self, cluster)?;
        let member = cluster.this_member().map(|member| member.client);
        if let Some(client) = member {
            self.server.listen = client;
        }
        Ok(())
    }

    /// With `[cluster]`, refuses what cluster mode cannot honor, each error naming its key and
    /// saying why: cores not given explicitly, a `max_keys` the shards cannot hold (or fewer
    /// than one per shard), and the settings that only a single node uses (`tokens.state_dir`,
    /// a `tokens.reservation` or `timer.tick_ms` other than their defaults). A configuration
    /// from [`Config::load`] or [`Config::from_toml_str`] has passed all but the first (the
    /// command line may give the cores): [`Config::with_overrides`] checks it all, and the
    /// server again when it starts (a configuration may be built in code).
    pub fn check_cluster_mode(&self) -> Result<(), ConfigError> {
        match &self.cluster {
            Some(cluster) => {
                cluster::check_cores(self)?;
                cluster::check_mode(self, cluster)
            }
            None => Ok(()),
        }
    }

    /// The configuration on one line, for the startup log: the address and limits, TLS (and
    /// whether clients must present certificates), the authorization rules, and the role (a
    /// single node, or which member of which cluster).
    pub fn summary(&self) -> String {
        let state_dir = match &self.tokens.state_dir {
            Some(path) => path.display().to_string(),
            None => "none".to_string(),
        };
        let tls = match &self.tls {
            None => "off",
            Some(tls) if tls.client_ca_file.is_some() => "on (mTLS: client certificates required)",
            Some(_) => "on (no client certificates)",
        };
        let role = match &self.cluster {
            None => "single node".to_string(),
            Some(cluster) => cluster.role(),
        };
        let health = (self.server.health_listen).map_or(String::new(), |addr| {
            format!(" health_listen={addr} (plaintext, /health only)")
        });
        format!(
            "listen={} cores={} max_connections={} max_keys={} max_waiters_per_key={} \
             max_pending_per_session={} max_key_bytes={} tick_ms={} state_dir={} tls={tls} \
             auth_rules={}{health}; {role}",
            self.server.listen,
            self.server.cores,
            self.limits.max_connections,
            self.limits.max_keys,
            self.limits.max_waiters_per_key,
            self.limits.max_pending_per_session,
            self.limits.max_key_bytes,
            self.timer.tick_ms,
            state_dir,
            self.auth_rules.len(),
        )
    }

    /// How many key entries each partition may hold: `max_keys / cores`, at least 1.
    pub fn max_keys_per_partition(&self) -> usize {
        self.limits.max_keys / self.server.cores
    }

    /// Sets the one key `setting` names, or refuses it.
    fn apply(&mut self, setting: &Setting) -> Result<(), ConfigError> {
        match (setting.section, setting.key) {
            ("server", "listen") => self.server.listen = setting.socket_address()?,
            ("server", "health_listen") => {
                let none = setting.string()?.is_empty();
                self.server.health_listen =
                    (!none).then(|| setting.socket_address()).transpose()?;
            }
            ("server", "cores") => {
                let cores = setting.usize_in(0, CORES_MAX)?;
                self.server.cores = cores_resolved(cores);
                self.server.cores_explicit = cores > 0;
            }
            ("limits", "max_connections") => {
                self.limits.max_connections = setting.usize_in(1, CONNECTIONS_MAX)?;
            }
            ("limits", "max_keys") => self.limits.max_keys = setting.usize_in(1, usize::MAX)?,
            ("limits", "max_waiters_per_key") => {
                self.limits.max_waiters_per_key = setting.u32_in(1, WAITERS_PER_KEY_MAX)?;
            }
            ("limits", "max_pending_per_session") => {
                self.limits.max_pending_per_session = setting.u32_in(1, PENDING_PER_SESSION_MAX)?;
            }
            ("limits", "max_key_bytes") => {
                self.limits.max_key_bytes = setting.usize_in(1, KEY_BYTES_MAX)?;
            }
            ("timer", "tick_ms") => self.timer.tick_ms = setting.u32_in(1, TICK_MS_MAX)?,
            ("tokens", "state_dir") => {
                let dir = setting.string()?;
                self.tokens.state_dir = (!dir.is_empty()).then(|| PathBuf::from(dir));
            }
            ("tokens", "reservation") => {
                self.tokens.reservation = setting.integer_in(RESERVATION_MIN, RESERVATION_MAX)?;
            }
            ("log", "level") => self.log.level = setting.level()?,
            ("log", "format") => self.log.format = setting.log_format()?,
            ("tls", "cert_file") => self.tls_mut().cert_file = setting.file()?,
            ("tls", "key_file") => self.tls_mut().key_file = setting.file()?,
            ("tls", "client_ca_file") => self.tls_mut().client_ca_file = Some(setting.file()?),
            ("auth", "rule") => self.auth_rules = auth::read_rules(setting.value, setting.line)?,
            ("cluster", "node_id") => {
                self.cluster_mut().node_id = setting.integer_in(1, u64::MAX >> 1)?;
            }
            ("cluster", "data_dir") => self.cluster_mut().data_dir = setting.file()?,
            ("cluster", "members") => {
                self.cluster_mut().members = cluster::read_members(setting.value, setting.line)?;
            }
            ("cluster", "shards") => {
                self.cluster_mut().shards = setting.u32_in(1, cluster::SHARDS_MAX)?;
            }
            ("cluster", "fsync") => self.cluster_mut().fsync = setting.boolean()?,
            ("cluster", "restore_from") => {
                self.cluster_mut().restore_from = Some(setting.file()?);
            }
            ("cluster", "tls") => {
                self.cluster_mut().tls = Some(tls::read_peer_tls(setting.value, setting.line)?);
            }
            _ => return Err(setting.unknown()),
        }
        Ok(())
    }

    fn cluster_mut(&mut self) -> &mut ClusterConfig {
        self.cluster.get_or_insert_with(ClusterConfig::default)
    }

    fn tls_mut(&mut self) -> &mut TlsConfig {
        self.tls.get_or_insert_with(TlsConfig::default)
    }

    /// Checks what relates two keys; single values were checked as they were read.
    fn check_relations(&self) -> Result<(), ConfigError> {
        if let Some(tls) = &self.tls {
            tls.check_required()?;
        }
        let client_certificates = self
            .tls
            .as_ref()
            .is_some_and(|t| t.client_ca_file.is_some());
        if !self.auth_rules.is_empty() && !client_certificates {
            let message = "auth.rule: rules need [tls] client_ca_file (a session's identity \
                           comes from its client certificate)"
                .to_string();
            return Err(ConfigError::new("auth.rule", None, message));
        }
        // A cluster splits max_keys over its shards instead (see `check_cluster_mode`).
        if self.cluster.is_none() && self.limits.max_keys < self.server.cores {
            let message = format!(
                "limits.max_keys: must be at least server.cores ({}), because each core's \
                 partition holds max_keys / cores keys, got {}",
                self.server.cores, self.limits.max_keys
            );
            return Err(ConfigError::new("limits.max_keys", None, message));
        }
        Ok(())
    }
}

/// `cores` as written (0 = one per CPU) resolved to a count in `1..=CORES_MAX`.
fn cores_resolved(cores: usize) -> usize {
    if cores > 0 {
        return cores.min(CORES_MAX);
    }
    std::thread::available_parallelism()
        .map_or(1, NonZeroUsize::get)
        .min(CORES_MAX)
}

/// A table's entries with the spans of their keys, which `toml::Table` does not keep.
type Entries = BTreeMap<Spanned<String>, Value>;
/// A known section's name and its entries in file order.
type Section = (String, Vec<(Spanned<String>, Value)>);

/// Splits the document into known sections, each with its entries, sections and entries in
/// file order (so the first error reported is the first in the file).
fn read_sections(text: &str) -> Result<Vec<Section>, ConfigError> {
    let top: Entries = toml::from_str(text).map_err(|error| syntax_error(text, &error))?;
    let top = in_file_order(top);
    for (name, value) in &top {
        check_section(
            name.get_ref(),
            line_column(text, name.span().start).0,
            value,
        )?;
    }
    // Every top-level value is now known to be a table, so this second, nested shape fits the
    // document; it is read only to keep the spans of the keys inside each section.
    let mut nested: BTreeMap<String, Entries> =
        toml::from_str(text).map_err(|error| syntax_error(text, &error))?;
    let sections = top
        .into_iter()
        .map(|(name, _)| {
            let entries = nested.remove(name.get_ref()).unwrap_or_default();
            (name.into_inner(), in_file_order(entries))
        })
        .collect();
    Ok(sections)
}

/// Refuses a top-level entry that is not one of the known sections, or not a table.
fn check_section(name: &str, line: usize, value: &Value) -> Result<(), ConfigError> {
    let known = SECTIONS.iter().any(|(section, _)| *section == name);
    let message = match (known, value) {
        (true, Value::Table(_)) => return Ok(()),
        (true, other) => format!(
            "`{name}` must be a section ([{name}]), got {}",
            described(other)
        ),
        (false, Value::Table(_)) => {
            format!(
                "unknown section `[{name}]` (known sections: {})",
                section_names()
            )
        }
        (false, _) => format!(
            "unknown key `{name}` outside any section (known sections: {})",
            section_names()
        ),
    };
    Err(ConfigError::new(name, Some(line), message))
}

fn section_names() -> String {
    let names: Vec<String> = SECTIONS
        .iter()
        .map(|(name, _)| format!("[{name}]"))
        .collect();
    names.join(", ")
}

fn in_file_order<V>(map: BTreeMap<Spanned<String>, V>) -> Vec<(Spanned<String>, V)> {
    let mut entries: Vec<_> = map.into_iter().collect();
    entries.sort_by_key(|(key, _)| key.span().start);
    entries
}

/// A TOML syntax error (or a shape the second read refuses) as one line with its position.
fn syntax_error(text: &str, error: &toml::de::Error) -> ConfigError {
    let (line, column) = match error.span() {
        Some(span) => {
            let (line, column) = line_column(text, span.start);
            (Some(line), Some(column))
        }
        None => (None, None),
    };
    let detail: Vec<&str> = error.message().lines().map(str::trim).collect();
    ConfigError {
        path: None,
        line,
        column,
        key: None,
        message: format!("invalid TOML: {}", detail.join("; ")),
    }
}

/// The 1-based line and column (in characters) of byte `offset` in `text`.
fn line_column(text: &str, offset: usize) -> (usize, usize) {
    let before = text.get(..offset).unwrap_or(text);
    let line_start = before.rfind('\n').map_or(0, |newline| newline + 1);
    let line = before.matches('\n').count() + 1;
    (line, before[line_start..].chars().count() + 1)
}

/// A value's type, with the value itself when it is short and printable on one line.
fn described(value: &Value) -> String {
    match value {
        Value::Array(_) => "an array".to_string(),
        Value::Table(_) => "a table".to_string(),
        Value::Datetime(datetime) => format!("datetime {datetime}"),
        Value::String(_) | Value::Integer(_) | Value::Float(_) | Value::Boolean(_) => {
            format!("{} {value}", value.type_str())
        }
    }
}

/// One `key = value` of the file, with where it is, for the checks and their errors.
struct Setting<'a> {
    section: &'a str,
    key: &'a str,
    line: usize,
    value: &'a Value,
}

impl Setting<'_> {
    /// `section.key`.
    fn path(&self) -> String {
        format!("{}.{}", self.section, self.key)
    }

    fn error(&self, problem: impl fmt::Display) -> ConfigError {
        let path = self.path();
        ConfigError::new(&path, Some(self.line), format!("{path}: {problem}"))
    }

    fn unknown(&self) -> ConfigError {
        let known = SECTIONS
            .iter()
            .find(|(section, _)| *section == self.section)
            .map_or(&[][..], |(_, keys)| *keys);
        let path = self.path();
        let message = format!(
            "unknown key `{path}` (known keys in [{}]: {})",
            self.section,
            known.join(", ")
        );
        ConfigError::new(&path, Some(self.line), message)
    }

    /// An integer in `min..=max`.
    fn integer_in(&self, min: u64, max: u64) -> Result<u64, ConfigError> {
        let Value::Integer(number) = *self.value else {
            return Err(self.error(format!(
                "expected an integer, got {}",
                described(self.value)
            )));
        };
        match u64::try_from(number) {
            Ok(n) if n < min => Err(self.error(format!("must be at least {min}, got {n}"))),
            Ok(n) if n > max => Err(self.error(format!("must be at most {max}, got {n}"))),
            Ok(n) => Ok(n),
            Err(_) => Err(self.error(format!("must be at least {min}, got {number}"))),
        }
    }

    fn usize_in(&self, min: usize, max: usize) -> Result<usize, ConfigError> {
        let widen = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        let number = self.integer_in(widen(min), widen(max))?;
        Ok(usize::try_from(number).expect("checked against a usize maximum"))
    }

    fn u32_in(&self, min: u32, max: u32) -> Result<u32, ConfigError> {
        let number = self.integer_in(u64::from(min), u64::from(max))?;
        Ok(u32::try_from(number).expect("checked against a u32 maximum"))
    }

    fn boolean(&self) -> Result<bool, ConfigError> {
        match self.value {
            Value::Boolean(value) => Ok(*value),
            other => Err(self.error(format!("expected true or false, got {}", described(other)))),
        }
    }

    fn string(&self) -> Result<&str, ConfigError> {
        match self.value {
            Value::String(text) => Ok(text),
            other => Err(self.error(format!("expected a string, got {}", described(other)))),
        }
    }

    fn socket_address(&self) -> Result<SocketAddr, ConfigError> {
        let text = self.string()?;
        text.parse().map_err(|_| {
            self.error(format!(
                "expected an IP address and port such as \"127.0.0.1:7420\" or \"[::1]:7420\" \
                 (host names are not resolved), got {:?}",
                text
            ))
        })
    }

    /// A non-empty path.
    fn file(&self) -> Result<PathBuf, ConfigError> {
        match self.string()? {
            "" => Err(self.error("expected a file path, got \"\"")),
            path => Ok(PathBuf::from(path)),
        }
    }

    fn log_format(&self) -> Result<LogFormat, ConfigError> {
        match self.string()? {
            "text" => Ok(LogFormat::Text),
            "json" => Ok(LogFormat::Json),
            other => Err(self.error(format!("must be \"text\" or \"json\", got {other:?}"))),
        }
    }

    fn level(&self) -> Result<LevelFilter, ConfigError> {
        let text = self.string()?;
        text.parse().map_err(|_| {
            self.error(format!(
                "must be one of off, error, warn, info, debug, trace, got {:?}",
                text
            ))
        })
    }
}

/// Why a configuration was refused. The message names the offending `section.key` (or the
/// unknown section or key), and the line and path when known; it is one line.
#[derive(Debug)]
pub struct ConfigError {
    path: Option<PathBuf>,
    line: Option<usize>,
    column: Option<usize>,
    key: Option<String>,
    message: String,
}

impl ConfigError {
    /// An error about `key`; `message` names it.
    fn new(key: &str, line: Option<usize>, message: String) -> ConfigError {
        ConfigError {
            path: None,
            line,
            column: None,
            key: Some(key.to_string()),
            message,
        }
    }

    /// The `section.key` (or the top-level name) the error is about, if it is about one.
    pub fn key(&self) -> Option<&str> {
        self.key.as_deref()
    }

    /// The 1-based line of the file the error is on, if it is on one.
    pub fn line(&self) -> Option<usize> {
        self.line
    }

    /// The file the configuration came from, for errors of [`Config::load`].
    pub fn path(&self) -> Option<&Path> {
        self.path.as_deref()
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // `path:line:column: message` as compilers print it, or `line L, column C: message`
        // when the text did not come from a file.
        match (&self.path, self.line, self.column) {
            (Some(path), Some(line), Some(column)) => {
                write!(f, "{}:{line}:{column}: ", path.display())?;
            }
            (Some(path), Some(line), None) => write!(f, "{}:{line}: ", path.display())?,
            (Some(path), None, _) => write!(f, "{}: ", path.display())?,
            (None, Some(line), Some(column)) => write!(f, "line {line}, column {column}: ")?,
            (None, Some(line), None) => write!(f, "line {line}: ")?,
            (None, None, _) => {}
        }
        f.write_str(&self.message)
    }
}

impl std::error::Error for ConfigError {}

mod auth;
mod cluster;
mod tls;
pub use auth::{AuthRule, PREFIXES_PER_RULE_MAX, RULES_MAX};
pub use cluster::{
    ClusterConfig, ClusterIdentity, MemberConfig, HOLDS_MAX, MEMBERS_MAX, SHARDS_DEFAULT,
    SHARDS_MAX,
};
pub use tls::{PeerTlsConfig, TlsConfig};

#[cfg(test)]
mod tests;
