//! The server's card: what `GET /cluster` on the lock port answers (docs/protocol.md §5, the
//! HTTP admin requests), so that a client given several addresses can tell whether they are
//! members of one cluster before it sends a lock request to any of them.
//!
//! The card is a few lines of text, one `name value` field per line:
//!
//! ```text
//! latchkey-card 1
//! cluster 5f1c0e2a9d3b7c41
//! member 2
//! shards 64
//! client 1 127.0.0.1:7420
//! client 2 127.0.0.1:7421
//! client 3 127.0.0.1:7422
//! ```
//!
//! or, for a server without `[cluster]`, `latchkey-card 1` then `standalone 9a0e…` (a number
//! drawn when the server started: two addresses answering the same one reach the same server).
//! A reader ignores lines it does not know (later builds may add some), and refuses a card
//! without its first line, with a field twice or malformed, or longer than [`CARD_BYTES_MAX`].
//!
//! This module is the card's one home: the server renders it with [`Card::render`], the Rust
//! client and the CLI read it with [`fetch`]; the Python client reads the same text.
//!
//! Deliberately not here: which addresses a client accepts (see `check.rs`).

use std::fmt::Write as _;
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::Instant;

use crate::tls::Connector;

/// The first line of every card, with its format version.
pub const CARD_FIRST_LINE: &str = "latchkey-card 1";
/// The longest answer (head and card) a reader takes.
pub const CARD_BYTES_MAX: usize = 16 * 1024;
/// The most `client` lines a card may carry.
pub const CARD_MEMBERS_MAX: usize = 64;

/// What a server says it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Card {
    /// A server without `[cluster]`, and the number it drew when it started.
    Standalone {
        /// Random per server run: the same on every address of one server.
        instance: u64,
    },
    /// A member of a cluster.
    Member {
        /// The cluster's identity: the same on every member of one cluster.
        cluster: u64,
        /// This member's id.
        member: u64,
        /// The cluster's shard count.
        shards: u32,
        /// Every member's id and client address, as this member's configuration lists them.
        clients: Vec<(u64, SocketAddr)>,
    },
}

/// Whom a card speaks for: two addresses with equal owners reach one server, or one cluster.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Owner {
    /// One standalone server (its instance number).
    Standalone(u64),
    /// One cluster (its identity).
    Cluster(u64),
}

impl std::fmt::Display for Owner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Owner::Standalone(instance) => write!(f, "a standalone server (run {instance:016x})"),
            Owner::Cluster(cluster) => write!(f, "cluster {cluster:016x}"),
        }
    }
}

impl Card {
    /// Whom this card speaks for.
    pub fn owner(&self) -> Owner {
        match self {
            Card::Standalone { instance } => Owner::Standalone(*instance),
            Card::Member { cluster, .. } => Owner::Cluster(*cluster),
        }
    }

    /// Whether the card lists `addr` as a member's client address.
    pub fn lists(&self, addr: SocketAddr) -> bool {
        match self {
            Card::Standalone { .. } => false,
            Card::Member { clients, .. } => clients.iter().any(|&(_, client)| client == addr),
        }
    }

    /// The card's text (see the module docs).
    pub fn render(&self) -> String {
        let mut text = format!("{CARD_FIRST_LINE}\n");
        match self {
            Card::Standalone { instance } => {
                let _ = writeln!(text, "standalone {instance:016x}");
            }
            Card::Member {
                cluster,
                member,
                shards,
                clients,
            } => {
                let _ = writeln!(text, "cluster {cluster:016x}");
                let _ = writeln!(text, "member {member}");
                let _ = writeln!(text, "shards {shards}");
                for (id, client) in clients {
                    let _ = writeln!(text, "client {id} {client}");
                }
            }
        }
        text
    }

    /// Reads a card's text; the error says what is wrong with it.
    pub fn parse(text: &str) -> Result<Card, String> {
        let mut lines = text.lines();
        if lines.next().map(str::trim_end) != Some(CARD_FIRST_LINE) {
            return Err(format!("its first line is not `{CARD_FIRST_LINE}`"));
        }
        let mut fields = Fields::default();
        for line in lines.map(str::trim_end) {
            let (name, value) = line.split_once(' ').unwrap_or((line, ""));
            fields.take(name, value)?;
        }
        fields.card()
    }
}

/// The fields of a card as they are read.
#[derive(Default)]
struct Fields {
    standalone: Option<u64>,
    cluster: Option<u64>,
    member: Option<u64>,
    shards: Option<u32>,
    clients: Vec<(u64, SocketAddr)>,
}

impl Fields {
    fn take(&mut self, name: &str, value: &str) -> Result<(), String> {
        let bad = |what: &str| format!("its `{name}` line is not {what}: {value:?}");
        let hex = |value: &str| u64::from_str_radix(value, 16).map_err(|_| bad("a hex number"));
        match name {
            "standalone" => set(&mut self.standalone, hex(value)?, name),
            "cluster" => set(&mut self.cluster, hex(value)?, name),
            "member" => set(
                &mut self.member,
                value.parse().map_err(|_| bad("a number"))?,
                name,
            ),
            "shards" => set(
                &mut self.shards,
                value.parse().map_err(|_| bad("a number"))?,
                name,
            ),
            "client" => {
                let (id, addr) = value.split_once(' ').ok_or_else(|| bad("`ID ADDRESS`"))?;
                let id = id.parse().map_err(|_| bad("`ID ADDRESS`"))?;
                let addr = addr.parse().map_err(|_| bad("`ID ADDRESS`"))?;
                if self.clients.len() >= CARD_MEMBERS_MAX {
                    return Err(format!("it lists more than {CARD_MEMBERS_MAX} members"));
                }
                self.clients.push((id, addr));
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn card(self) -> Result<Card, String> {
        match (self.standalone, self.cluster, self.member, self.shards) {
            (Some(instance), None, None, None) if self.clients.is_empty() => {
                Ok(Card::Standalone { instance })
            }
            (None, Some(cluster), Some(member), Some(shards)) if !self.clients.is_empty() => {
                Ok(Card::Member {
                    cluster,
                    member,
                    shards,
                    clients: self.clients,
                })
            }
            _ => Err("it is neither a standalone server's nor a member's".to_string()),
        }
    }
}

fn set<T>(slot: &mut Option<T>, value: T, name: &str) -> Result<(), String> {
    match slot.replace(value) {
        None => Ok(()),
        Some(_) => Err(format!("it has two `{name}` lines")),
    }
}

/// Why [`fetch`] has no card.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FetchError {
    /// Nothing listens at the address: the connection was refused.
    Refused(String),
    /// The server could not be reached, or did not answer before the deadline: try later.
    Unreachable(String),
    /// The server answered, but not with a card: not latchkey, or a build before cards.
    NotACard(String),
}

impl std::fmt::Display for FetchError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FetchError::Refused(cause) | FetchError::Unreachable(cause) => {
                write!(f, "could not be asked: {cause}")
            }
            FetchError::NotACard(cause) => write!(
                f,
                "answered GET /cluster without a card ({cause}): not a latchkey server, or one \
                 older than this client"
            ),
        }
    }
}

/// Asks the server at `addr` for its card (over TLS when `tls` is set), all by `deadline`.
pub fn fetch(
    addr: SocketAddr,
    tls: Option<&Connector>,
    deadline: Instant,
) -> Result<Card, FetchError> {
    let answer = get(addr, tls, deadline).map_err(|error| {
        let cause = error.to_string();
        if error.kind() == io::ErrorKind::ConnectionRefused {
            return FetchError::Refused(cause);
        }
        let late = matches!(
            error.kind(),
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
        );
        FetchError::Unreachable(match late && !cause.starts_with(CANNOT_CONNECT) {
            true => "no answer to GET /cluster in time".to_string(),
            false => cause,
        })
    })?;
    card_of_answer(&answer)
}

/// The card in an HTTP answer, or why there is none: [`FetchError::Unreachable`] (ask again
/// later) for no answer at all, an answer cut short, or a `5xx` (a server at its limits or
/// shutting down); [`FetchError::NotACard`] for anything else that is not a card.
pub fn card_of_answer(answer: &[u8]) -> Result<Card, FetchError> {
    let later = |why: &str| Err(FetchError::Unreachable(why.to_string()));
    let not_a_card = |why: String| Err(FetchError::NotACard(why));
    if answer.is_empty() {
        return later("it closed the connection without answering GET /cluster");
    }
    let Some(end) = answer.windows(4).position(|w| w == b"\r\n\r\n") else {
        if answer.starts_with(b"HTTP/1.") {
            return later("its answer to GET /cluster ended early");
        }
        return not_a_card("no HTTP answer".to_string());
    };
    let head = String::from_utf8_lossy(&answer[..end]);
    let status = head.lines().next().unwrap_or("");
    if !status.starts_with("HTTP/1.") {
        return not_a_card("no HTTP answer".to_string());
    }
    let code = status.split(' ').nth(1).unwrap_or("");
    if code.starts_with('5') {
        return Err(FetchError::Unreachable(format!(
            "GET /cluster: HTTP {code}"
        )));
    }
    if code != "200" {
        return not_a_card(format!("HTTP {code}"));
    }
    let Ok(body) = std::str::from_utf8(&answer[end + 4..]) else {
        return not_a_card("not text".to_string());
    };
    Card::parse(body).or_else(|cause| not_a_card(format!("a card that is not valid: {cause}")))
}

/// How a failed connect is said, as a session says it.
const CANNOT_CONNECT: &str = "cannot connect:";

/// One `GET /cluster`, read to the server's close (at most [`CARD_BYTES_MAX`] bytes).
fn get(addr: SocketAddr, tls: Option<&Connector>, deadline: Instant) -> io::Result<Vec<u8>> {
    let left = || {
        let left = deadline.saturating_duration_since(Instant::now());
        match left.is_zero() {
            true => Err(io::Error::new(io::ErrorKind::TimedOut, "timed out")),
            false => Ok(left),
        }
    };
    let tcp = TcpStream::connect_timeout(&addr, left()?).map_err(|error| {
        io::Error::new(error.kind(), format!("{CANNOT_CONNECT} {}", error.kind()))
    })?;
    tcp.set_nodelay(true)?;
    let request = b"GET /cluster HTTP/1.1\r\nHost: latchkey\r\nConnection: close\r\n\r\n";
    match tls {
        None => exchange(tcp, request, left),
        Some(connector) => {
            let stream = connector.handshake(tcp, addr, deadline)?;
            exchange(stream, request, left)
        }
    }
}

/// Writes `request` and reads the answer to its end, each step within the time `left`.
fn exchange<S: Read + Write + Timeouts>(
    mut stream: S,
    request: &[u8],
    left: impl Fn() -> io::Result<std::time::Duration>,
) -> io::Result<Vec<u8>> {
    stream.timeouts(left()?)?;
    stream.write_all(request)?;
    stream.flush()?;
    let mut answer = Vec::new();
    let mut buffer = [0u8; 4096];
    loop {
        stream.timeouts(left()?)?;
        let read = match stream.read(&mut buffer) {
            Ok(read) => read,
            // A TLS server may close without close_notify: the answer is what came.
            Err(error) if error.kind() == io::ErrorKind::UnexpectedEof => 0,
            Err(error) => return Err(error),
        };
        if read == 0 {
            return Ok(answer);
        }
        if answer.len() + read > CARD_BYTES_MAX {
            let message = format!("the answer is longer than {CARD_BYTES_MAX} bytes");
            return Err(io::Error::new(io::ErrorKind::InvalidData, message));
        }
        answer.extend_from_slice(&buffer[..read]);
    }
}

/// A blocking stream whose socket timeouts can be set.
trait Timeouts {
    fn timeouts(&mut self, left: std::time::Duration) -> io::Result<()>;
}

impl Timeouts for TcpStream {
    fn timeouts(&mut self, left: std::time::Duration) -> io::Result<()> {
        self.set_read_timeout(Some(left))?;
        self.set_write_timeout(Some(left))
    }
}

impl Timeouts for rustls::StreamOwned<rustls::ClientConnection, TcpStream> {
    fn timeouts(&mut self, left: std::time::Duration) -> io::Result<()> {
        self.sock.timeouts(left)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member() -> Card {
        Card::Member {
            cluster: 0x5f1c_0e2a_9d3b_7c41,
            member: 2,
            shards: 64,
            clients: vec![
                (1, "127.0.0.1:7420".parse().unwrap()),
                (2, "[::1]:7421".parse().unwrap()),
            ],
        }
    }

    #[test]
    fn a_card_reads_back_as_it_was_rendered() {
        let standalone = Card::Standalone { instance: 7 };
        for card in [member(), standalone] {
            assert_eq!(Card::parse(&card.render()), Ok(card));
        }
        let text = member().render();
        assert!(text.starts_with("latchkey-card 1\ncluster 5f1c0e2a9d3b7c41\nmember 2\n"));
        assert!(text.ends_with("client 2 [::1]:7421\n"), "{text}");
    }

    #[test]
    fn unknown_lines_are_ignored_and_bad_cards_refused() {
        let later = format!("{}version 9 and more\n", member().render());
        assert_eq!(Card::parse(&later), Ok(member()));
        let refused = [
            "",
            "latchkey-card 2\nstandalone 1\n",
            "latchkey-card 1\n",
            "latchkey-card 1\nstandalone zz\n",
            "latchkey-card 1\nstandalone 1\nstandalone 2\n",
            "latchkey-card 1\nstandalone 1\ncluster 2\nmember 1\nshards 1\nclient 1 1.2.3.4:5\n",
            "latchkey-card 1\ncluster 2\nmember 1\nshards 1\n",
            "latchkey-card 1\ncluster 2\nmember 1\nshards 1\nclient 1 nowhere\n",
        ];
        for text in refused {
            assert!(Card::parse(text).is_err(), "{text:?}");
        }
        let many: String = (0..=CARD_MEMBERS_MAX)
            .map(|n| format!("client {n} 127.0.0.1:1\n"))
            .collect();
        let many = format!("{CARD_FIRST_LINE}\ncluster 1\nmember 1\nshards 1\n{many}");
        assert!(Card::parse(&many).unwrap_err().contains("more than"));
    }

    #[test]
    fn an_answer_is_a_card_only_with_status_200() {
        let body = member().render();
        let ok = format!(
            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        );
        assert_eq!(card_of_answer(ok.as_bytes()), Ok(member()));
        let not_a_card = |answer: &[u8]| match card_of_answer(answer) {
            Err(FetchError::NotACard(why)) => why,
            other => panic!("{other:?}"),
        };
        let missing = b"HTTP/1.1 404 Not Found\r\n\r\nno such page";
        assert_eq!(not_a_card(missing), "HTTP 404");
        assert_eq!(not_a_card(b"X 1 0\n"), "no HTTP answer");
        assert!(not_a_card(b"HTTP/1.1 200 OK\r\n\r\nhello").contains("not valid"));
        // No answer, one cut short, or a server at its limits: ask again later.
        let busy = b"HTTP/1.1 503 Service Unavailable\r\n\r\ntoo many admin requests";
        for later in [&b""[..], b"HTTP/1.1 200 OK\r\nContent-", busy] {
            let answer = card_of_answer(later);
            assert!(
                matches!(answer, Err(FetchError::Unreachable(_))),
                "{answer:?}"
            );
        }
    }
}
