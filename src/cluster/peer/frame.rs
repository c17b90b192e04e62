//! The member ↔ member wire format: a hello, its reply, then envelopes. No I/O.
//!
//! A connection carries raft messages one way: the member that opened it (the *dialer*) writes,
//! the other (the *reader*) reads. It begins with a [`Hello`] of [`HELLO_BYTES`] bytes
//! ([`hello_bytes`] of its version: the incarnation came with version 6):
//!
//! ```text
//! [magic "LKPR"][version u8][cluster shards u32 BE][from node id u64 BE][to node id u64 BE]
//! [cluster identity digest u64 BE][data-directory incarnation u64 BE]
//! ```
//!
//! `to` is the member the dialer meant to reach, so a reader reached at a wrong address says so;
//! the identity digest ([`crate::config::ClusterIdentity`]) is the shard count and every
//! member's id and client address, so members configured with different member lists refuse
//! each other; the incarnation is the dialer's data directory's
//! ([`crate::cluster::data_dir::DataDir::incarnation`]), so a member started again on another
//! `data_dir` is refused by the peers that knew the old one ([`super::incarnations`]). The
//! reader answers with one [`Reply`] of [`REPLY_BYTES`] bytes, the only bytes that ever flow
//! back:
//!
//! ```text
//! [magic "LKPR"][version u8][verdict u8][its shards u32 BE][its node id u64 BE][its digest u64 BE]
//! ```
//!
//! A refusal is sent, then the connection closed, so the refusal is logged on both sides. A
//! dialer sends envelopes only after an accepting reply, each one raft message for one shard:
//!
//! ```text
//! [len u32 BE][shard u32 BE][protobuf bytes of raft::eraftpb::Message]
//! ```
//!
//! `len` counts the bytes after itself (the shard and the message), at least 4 and at most
//! [`FRAME_BYTES_MAX`]. [`decode`] checks the length before anything is allocated for it, and
//! borrows the message bytes from the caller's buffer ("incomplete" is `Ok(None)`). An envelope
//! for shard [`KEEPALIVE_SHARD`] with no message is a keepalive: a dialer with nothing to send
//! writes one every [`KEEPALIVE_INTERVAL`], so that a reader hears from every live peer.
//!
//! # Versions
//!
//! The version byte of a hello is the wire version its dialer speaks on that connection; a
//! build speaks every version from [`VERSION_MIN`] to [`VERSION`]:
//!
//! * 2: `to`, the identity, replies.
//! * 3: the same frames; the shard commands of version 2 (one entry per handoff), which a
//!   version-2 member cannot apply: members of 2 and 3 refuse each other.
//! * 4: the same frames; shard commands of version 3 (replicated waiters) may be proposed once
//!   every member speaks 4.
//! * 5: the same frames; shard commands of version 4 (a `Withdraw` that says how its acquire
//!   was answered) may be proposed once every member speaks 5.
//! * 6: the hello carries the dialer's data-directory incarnation (8 bytes more), which a
//!   reader checks against the one it remembers ([`Verdict::Incarnation`]); the same shard
//!   commands as 5.
//!
//! A reader accepts a hello of any version it speaks ([`Hello::decode`] reports which) and
//! replies in the hello's version: a dialer of an earlier build (one that speaks 3 alone and
//! checks that a reply's version byte is exactly 3, or one that speaks 3 and 4) reads it. A
//! hello of a version it does not speak is refused with [`Verdict::Version`] in a reply
//! carrying the reader's newest version ([`VERSION`]); a reader of an earlier build does the
//! same with its newest (3 or 4). A dialer that speaks
//! the version such a refusal carries dials again in it ([`Reply::fallback`]); any other reply
//! in a version other than its hello's is refused ([`Reply::refusal`]). The frames after the
//! reply are the same in every version: what a version changes is which shard commands a
//! leader may propose, decided by the *cluster version* (the lowest version any member speaks,
//! `super::versions`), never by one connection's.
//!
//! Deliberately not here: parsing the protobuf (the reader checks its shape with
//! [`super::wire`] and parses it, so that a bad message closes the connection like any other
//! bad frame), sockets, and acknowledgements (raft has its own).

use raft::eraftpb::Message;
use std::fmt;
use std::time::Duration;

/// The first four bytes of every peer connection, and of the reply.
pub const MAGIC: [u8; 4] = *b"LKPR";
/// The newest version of this wire format, this build's (see "Versions" in the module docs):
/// 6, whose hello carries the dialer's data-directory incarnation.
pub const VERSION: u8 = 6;
/// The oldest version this build forms a group with: 3, the previous build's only version (2
/// cannot apply the shard commands of version 2 that 3 brought, so it stays refused).
pub const VERSION_MIN: u8 = 3;
/// Bytes in a hello of versions before 6: magic, version, shard count, from, to, identity
/// digest.
pub const HELLO_BYTES_BEFORE_6: usize = 4 + 1 + 4 + 8 + 8 + 8;
/// Bytes in a hello of [`VERSION`], the most of any version: those of version 5, then the
/// incarnation.
pub const HELLO_BYTES: usize = HELLO_BYTES_BEFORE_6 + 8;
/// The first version whose hello carries the dialer's incarnation.
pub const VERSION_INCARNATION: u8 = 6;
/// Bytes in a reply: magic, version, verdict, shard count, node id, identity digest.
pub const REPLY_BYTES: usize = 4 + 1 + 1 + 4 + 8 + 8;
/// Bytes of the `len` field that starts every envelope.
pub const LEN_BYTES: usize = 4;
/// Bytes before the message in an envelope: `len` and `shard`.
pub const HEADER_BYTES: usize = LEN_BYTES + 4;
/// The largest `len` accepted or sent: 16 MiB (shard and message). A bigger envelope closes the
/// connection that announced it; a bigger outgoing message is dropped and counted.
pub const FRAME_BYTES_MAX: usize = 16 << 20;
/// The shard of a keepalive envelope (no cluster has this many shards).
pub const KEEPALIVE_SHARD: u32 = u32::MAX;
/// The bytes of a keepalive envelope.
pub const KEEPALIVE: [u8; HEADER_BYTES] = [0, 0, 0, 4, 0xff, 0xff, 0xff, 0xff];
/// A dialer that wrote nothing for this long writes a keepalive.
pub const KEEPALIVE_INTERVAL: Duration = Duration::from_millis(200);

const _: () = assert!(0 < VERSION_MIN && VERSION_MIN <= VERSION);
const _: () = assert!(FRAME_BYTES_MAX <= u32::MAX as usize);
const _: () = assert!(FRAME_BYTES_MAX > HEADER_BYTES);
const _: () = assert!(KEEPALIVE_SHARD as u64 > crate::config::SHARDS_MAX as u64);

/// Whether this build speaks wire version `version` ([`VERSION_MIN`]`..=`[`VERSION`]).
pub fn speaks(version: u8) -> bool {
    (VERSION_MIN..=VERSION).contains(&version)
}

/// The bytes of a hello in `version` (one this build [`speaks`]).
pub const fn hello_bytes(version: u8) -> usize {
    if version >= VERSION_INCARNATION {
        HELLO_BYTES
    } else {
        HELLO_BYTES_BEFORE_6
    }
}

/// The hello that opens a peer connection: the version the writer speaks on it, who is
/// writing, whom it meant to reach, and the cluster it believes in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The wire version the writer speaks on this connection: its newest, or an older one the
    /// reader asked for by refusing the newest ([`Reply::fallback`]). A reader accepts any
    /// version it [`speaks`].
    pub version: u8,
    /// The cluster's shard count, which must be the reader's own.
    pub shards: u32,
    /// The writing member's node id, which must be one of the reader's peers.
    pub from: u64,
    /// The member the writer meant to reach, which must be the reader.
    pub to: u64,
    /// The writer's cluster identity digest, which must be the reader's own.
    pub identity: u64,
    /// The writer's data-directory incarnation, which must be the one the reader remembers for
    /// it, if any ([`super::incarnations`]). Sent from version 6 on; 0 in a hello of an earlier
    /// version (an incarnation is never 0).
    pub incarnation: u64,
}

/// What a reader checks a hello against: itself.
#[derive(Clone, Copy, Debug)]
pub struct Local<'a> {
    /// The reader's shard count.
    pub shards: u32,
    /// The reader's node id.
    pub node_id: u64,
    /// The reader's cluster identity digest.
    pub identity: u64,
    /// The reader's peers' node ids (itself not among them).
    pub peers: &'a [u64],
}

/// Why a hello was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HelloError {
    /// The connection did not begin with [`MAGIC`] (these are the bytes it began with): not a
    /// latchkey peer, so no reply is sent.
    Magic([u8; 4]),
    /// A version this member does not [`speaks`] (answered with this member's newest).
    Version(u8),
    /// A shard count other than the reader's.
    Shards {
        /// The reader's shard count.
        ours: u32,
        /// The count in the hello.
        theirs: u32,
    },
    /// A node id that is not one of the reader's peers (the reader's own id included).
    UnknownNode(u64),
    /// The writer meant to reach another member: its peer address for `to` leads here.
    WrongMember {
        /// The writer.
        from: u64,
        /// The member it meant to reach.
        to: u64,
        /// The member it reached (the reader).
        reached: u64,
    },
    /// Another cluster identity: the members lists (ids, client addresses) or shard counts
    /// differ.
    Identity {
        /// The writer.
        from: u64,
        /// The reader's digest.
        ours: u64,
        /// The writer's digest.
        theirs: u64,
    },
    /// The writer's data directory is not the one the reader knew it by: lost or replaced,
    /// with the votes it gave ([`super::incarnations`]).
    Incarnation {
        /// The writer.
        from: u64,
        /// The incarnation the reader remembers for it.
        known: u64,
        /// The incarnation in the hello.
        theirs: u64,
    },
}

/// Whether a connection's first bytes are a TLS record's (a handshake, an alert...): a content
/// type 20 to 23, then major version 3. A member with `[cluster.tls]` sends them where one
/// without expects [`MAGIC`], and the other way round.
pub fn looks_like_tls(first: &[u8; 4]) -> bool {
    matches!(first, [0x14..=0x17, 0x03, ..])
}

impl HelloError {
    /// Whether the dialer began with a TLS record: it has `[cluster.tls]`, the reader has not.
    pub fn is_tls(&self) -> bool {
        matches!(self, HelloError::Magic(first) if looks_like_tls(first))
    }

    /// The verdict to reply with, if any (none to a stranger that is not a latchkey peer).
    pub fn verdict(&self) -> Option<Verdict> {
        match self {
            HelloError::Magic(_) => None,
            HelloError::Version(_) => Some(Verdict::Version),
            HelloError::Shards { .. } => Some(Verdict::Shards),
            HelloError::UnknownNode(_) => Some(Verdict::UnknownNode),
            HelloError::WrongMember { .. } => Some(Verdict::WrongMember),
            HelloError::Identity { .. } => Some(Verdict::Identity),
            HelloError::Incarnation { .. } => Some(Verdict::Incarnation),
        }
    }
}

impl fmt::Display for HelloError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            HelloError::Magic(bytes) if looks_like_tls(&bytes) => write!(
                f,
                "a TLS handshake: the dialer has [cluster.tls], this member has not (every \
                 member must have it, or none)"
            ),
            HelloError::Magic(bytes) => write!(f, "bad magic {bytes:02x?} (not a latchkey peer)"),
            HelloError::Version(version) => {
                write!(
                    f,
                    "peer wire version {version}, this member speaks {VERSION_MIN} to {VERSION}"
                )
            }
            HelloError::Shards { ours, theirs } => {
                write!(f, "peer has {theirs} shards, this member has {ours}")
            }
            HelloError::UnknownNode(id) => write!(f, "node id {id} is not a peer of this member"),
            HelloError::WrongMember { from, to, reached } => write!(
                f,
                "node {from} dialed node {to} but reached node {reached}: member {from}'s peer \
                 address for {to} is wrong"
            ),
            HelloError::Identity { from, ours, theirs } => write!(
                f,
                "cluster identity differs: node {from} has {theirs:016x}, this member \
                 {ours:016x} (their members lists or shard counts differ)"
            ),
            HelloError::Incarnation {
                from,
                known,
                theirs,
            } => write!(
                f,
                "node {from} says hello from data-directory incarnation {theirs:016x}, this \
                 member knew it as {known:016x}: its data_dir was lost or replaced, and with it \
                 the votes it gave, so it may not rejoin as node {from} (see \"A member that \
                 lost its disk\" in docs/cluster.md)"
            ),
        }
    }
}

fn u32_at(bytes: &[u8], at: usize) -> u32 {
    let mut word = [0u8; 4];
    word.copy_from_slice(&bytes[at..at + 4]);
    u32::from_be_bytes(word)
}

fn u64_at(bytes: &[u8], at: usize) -> u64 {
    let mut word = [0u8; 8];
    word.copy_from_slice(&bytes[at..at + 8]);
    u64::from_be_bytes(word)
}

/// Checks magic and version as soon as their bytes are there (so garbage is refused at once):
/// `Err` with the bytes seen, or a version this build does not speak.
fn check_preamble(bytes: &[u8]) -> Result<(), PreambleError> {
    let magic_seen = bytes.len().min(MAGIC.len());
    if bytes[..magic_seen] != MAGIC[..magic_seen] {
        let mut magic = [0u8; 4];
        magic[..magic_seen].copy_from_slice(&bytes[..magic_seen]);
        return Err(PreambleError::Magic(magic));
    }
    match bytes.get(4) {
        Some(&version) if !speaks(version) => Err(PreambleError::Version(version)),
        _ => Ok(()),
    }
}

enum PreambleError {
    Magic([u8; 4]),
    Version(u8),
}

impl Hello {
    /// The hello's bytes: [`hello_bytes`] of its version (the incarnation from version 6 on).
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = vec![0u8; hello_bytes(self.version)];
        bytes[..4].copy_from_slice(&MAGIC);
        bytes[4] = self.version;
        bytes[5..9].copy_from_slice(&self.shards.to_be_bytes());
        bytes[9..17].copy_from_slice(&self.from.to_be_bytes());
        bytes[17..25].copy_from_slice(&self.to.to_be_bytes());
        bytes[25..33].copy_from_slice(&self.identity.to_be_bytes());
        if let Some(incarnation) = bytes.get_mut(33..41) {
            incarnation.copy_from_slice(&self.incarnation.to_be_bytes());
        }
        bytes
    }

    /// Reads a hello from the start of `bytes`: `Ok(None)` until [`hello_bytes`] of its
    /// version are there. Magic and version are checked as soon as their bytes arrive, so
    /// garbage is refused at once; [`Hello::check`] checks the rest. The hello's version is one
    /// this build [`speaks`]: the reply must be in it ([`Reply::version`]). A hello before
    /// version 6 reads with incarnation 0.
    pub fn decode(bytes: &[u8]) -> Result<Option<Hello>, HelloError> {
        check_preamble(bytes).map_err(|error| match error {
            PreambleError::Magic(magic) => HelloError::Magic(magic),
            PreambleError::Version(version) => HelloError::Version(version),
        })?;
        let Some(&version) = bytes.get(4) else {
            return Ok(None);
        };
        let Some(bytes) = bytes.get(..hello_bytes(version)) else {
            return Ok(None);
        };
        let incarnation = match bytes.len() {
            HELLO_BYTES => u64_at(bytes, 33),
            _ => 0,
        };
        Ok(Some(Hello {
            version,
            shards: u32_at(bytes, 5),
            from: u64_at(bytes, 9),
            to: u64_at(bytes, 17),
            identity: u64_at(bytes, 25),
            incarnation,
        }))
    }

    /// The bytes this hello takes on the wire.
    pub fn encoded_len(&self) -> usize {
        hello_bytes(self.version)
    }

    /// Checks the hello against the reader (`local`): the shard count, the sender, the
    /// recipient, then the identity.
    pub fn check(&self, local: &Local<'_>) -> Result<(), HelloError> {
        if self.shards != local.shards {
            let (ours, theirs) = (local.shards, self.shards);
            return Err(HelloError::Shards { ours, theirs });
        }
        if !local.peers.contains(&self.from) || self.from == local.node_id {
            return Err(HelloError::UnknownNode(self.from));
        }
        if self.to != local.node_id {
            let (from, to, reached) = (self.from, self.to, local.node_id);
            return Err(HelloError::WrongMember { from, to, reached });
        }
        if self.identity != local.identity {
            let (from, ours, theirs) = (self.from, local.identity, self.identity);
            return Err(HelloError::Identity { from, ours, theirs });
        }
        Ok(())
    }
}

/// A reader's answer to a hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Verdict {
    /// Envelopes may follow.
    Accepted = 0,
    /// Refused: another wire version.
    Version = 1,
    /// Refused: another shard count.
    Shards = 2,
    /// Refused: the dialer is not one of the reader's peers.
    UnknownNode = 3,
    /// Refused: the dialer meant to reach another member.
    WrongMember = 4,
    /// Refused: another cluster identity.
    Identity = 5,
    /// Refused: the dialer's data directory is not the one the reader knew (version 6 on).
    Incarnation = 6,
}

impl Verdict {
    fn from_byte(byte: u8) -> Option<Verdict> {
        const ALL: [Verdict; 7] = [
            Verdict::Accepted,
            Verdict::Version,
            Verdict::Shards,
            Verdict::UnknownNode,
            Verdict::WrongMember,
            Verdict::Identity,
            Verdict::Incarnation,
        ];
        ALL.into_iter().find(|verdict| *verdict as u8 == byte)
    }
}

/// The reply to a hello: its version, the verdict, and who the reader is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reply {
    /// The hello's version, or, refusing a version ([`Verdict::Version`]), the reader's newest.
    pub version: u8,
    /// Accepted, or why not.
    pub verdict: Verdict,
    /// The reader's shard count.
    pub shards: u32,
    /// The reader's node id.
    pub node_id: u64,
    /// The reader's cluster identity digest.
    pub identity: u64,
}

/// Why a reply could not be read; the connection is closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplyError {
    /// The reply did not begin with [`MAGIC`].
    Magic([u8; 4]),
    /// The reply is in a wire version this member does not [`speaks`].
    Version(u8),
    /// A verdict byte this version does not know.
    Verdict(u8),
}

impl fmt::Display for ReplyError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReplyError::Magic(bytes) if looks_like_tls(bytes) => write!(
                f,
                "a TLS record instead of a reply: it has [cluster.tls], this member has not \
                 (every member must have it, or none)"
            ),
            ReplyError::Magic(bytes) => {
                write!(
                    f,
                    "a reply with bad magic {bytes:02x?} (not a latchkey peer)"
                )
            }
            ReplyError::Version(version) => {
                write!(
                    f,
                    "it speaks peer wire version {version}, this member {VERSION_MIN} to \
                     {VERSION}"
                )
            }
            ReplyError::Verdict(byte) => write!(f, "a reply with an unknown verdict {byte}"),
        }
    }
}

impl Reply {
    /// The reply's bytes.
    pub fn encode(&self) -> [u8; REPLY_BYTES] {
        let mut bytes = [0u8; REPLY_BYTES];
        bytes[..4].copy_from_slice(&MAGIC);
        bytes[4] = self.version;
        bytes[5] = self.verdict as u8;
        bytes[6..10].copy_from_slice(&self.shards.to_be_bytes());
        bytes[10..18].copy_from_slice(&self.node_id.to_be_bytes());
        bytes[18..].copy_from_slice(&self.identity.to_be_bytes());
        bytes
    }

    /// Reads a reply from the start of `bytes`: `Ok(None)` until [`REPLY_BYTES`] are there
    /// (magic and version are checked as soon as they arrive: a version this build does not
    /// [`speaks`] is refused; whether it is the hello's is [`Reply::refusal`]'s to say).
    pub fn decode(bytes: &[u8]) -> Result<Option<Reply>, ReplyError> {
        check_preamble(bytes).map_err(|error| match error {
            PreambleError::Magic(magic) => ReplyError::Magic(magic),
            PreambleError::Version(version) => ReplyError::Version(version),
        })?;
        let Some(bytes) = bytes.get(..REPLY_BYTES) else {
            return Ok(None);
        };
        let verdict = Verdict::from_byte(bytes[5]).ok_or(ReplyError::Verdict(bytes[5]))?;
        Ok(Some(Reply {
            version: bytes[4],
            verdict,
            shards: u32_at(bytes, 6),
            node_id: u64_at(bytes, 10),
            identity: u64_at(bytes, 18),
        }))
    }

    /// The version the dialer that sent `hello` should dial again in, at once: when this reply
    /// refuses the hello's version and names another one this build [`speaks`] (a reader of
    /// an older build, or, after a fallback, one that was upgraded since). `None` otherwise.
    pub fn fallback(&self, hello: &Hello) -> Option<u8> {
        let other = self.version != hello.version && speaks(self.version);
        (self.verdict == Verdict::Version && other).then_some(self.version)
    }

    /// Why the dialer that sent `hello` may not send envelopes on this connection, in words;
    /// `None` when the reply accepts it in the hello's version and names the member and
    /// cluster it meant to reach. (A refusal with a [`Reply::fallback`] is one too: the
    /// dialer asks that first.)
    pub fn refusal(&self, hello: &Hello) -> Option<String> {
        let (from, to, reached) = (hello.from, hello.to, self.node_id);
        if self.version != hello.version && self.verdict != Verdict::Version {
            return Some(format!(
                "it replied in peer wire version {} to a hello in version {}",
                self.version, hello.version
            ));
        }
        let why = match self.verdict {
            Verdict::Accepted if reached == to && self.identity == hello.identity => return None,
            Verdict::Accepted | Verdict::WrongMember if reached != to => format!(
                "node {from} dialed node {to} but reached node {reached}: member {from}'s peer \
                 address for {to} is wrong"
            ),
            Verdict::Accepted | Verdict::Identity => format!(
                "cluster identity differs: node {reached} has {:016x}, this member {:016x} \
                 (their members lists or shard counts differ)",
                self.identity, hello.identity
            ),
            Verdict::Version => format!(
                "it does not speak peer wire version {} (it speaks {})",
                hello.version, self.version
            ),
            Verdict::Shards => format!(
                "it has {} shards, this member has {}",
                self.shards, hello.shards
            ),
            Verdict::UnknownNode => {
                format!("this member's id {from} is not in node {reached}'s members list")
            }
            Verdict::WrongMember => format!("node {reached} says it is not the member dialed"),
            Verdict::Incarnation => format!(
                "node {reached} knew this member by another data directory than this one \
                 (incarnation {:016x}): this member's data_dir was lost or replaced, and with it \
                 the votes it gave, so it may not rejoin as node {from} (see \"A member that \
                 lost its disk\" in docs/cluster.md)",
                hello.incarnation
            ),
        };
        Some(why)
    }
}

/// One envelope, borrowed from the read buffer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Envelope<'a> {
    /// The shard (raft group) the message belongs to. Not checked against the shard count here.
    pub shard: u32,
    /// The protobuf bytes of the `raft::eraftpb::Message`, not yet parsed.
    pub message: &'a [u8],
}

impl Envelope<'_> {
    /// Whether this is a keepalive (shard [`KEEPALIVE_SHARD`], no message).
    pub fn is_keepalive(&self) -> bool {
        self.shard == KEEPALIVE_SHARD && self.message.is_empty()
    }
}

/// Why an envelope could not be read; the connection is closed.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// `len` above [`FRAME_BYTES_MAX`] (the announced length).
    TooLarge(u32),
    /// `len` below 4: no room for the shard (the announced length).
    TooShort(u32),
}

impl fmt::Display for FrameError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FrameError::TooLarge(len) => {
                write!(f, "envelope of {len} bytes, the limit is {FRAME_BYTES_MAX}")
            }
            FrameError::TooShort(len) => write!(f, "envelope of {len} bytes has no shard"),
        }
    }
}

/// The `len` announced at the start of `bytes`, checked: `Ok(None)` before 4 bytes are there.
/// A reader uses it to size its buffer for the envelope before the rest arrives.
pub fn announced_len(bytes: &[u8]) -> Result<Option<usize>, FrameError> {
    let Some(len) = bytes.get(..LEN_BYTES) else {
        return Ok(None);
    };
    let len = u32::from_be_bytes([len[0], len[1], len[2], len[3]]);
    if len as usize > FRAME_BYTES_MAX {
        return Err(FrameError::TooLarge(len));
    }
    if (len as usize) < HEADER_BYTES - LEN_BYTES {
        return Err(FrameError::TooShort(len));
    }
    Ok(Some(len as usize))
}

/// Reads the envelope at the start of `bytes`: the envelope and the bytes it used, `Ok(None)`
/// while it is incomplete.
pub fn decode(bytes: &[u8]) -> Result<Option<(Envelope<'_>, usize)>, FrameError> {
    let Some(len) = announced_len(bytes)? else {
        return Ok(None);
    };
    let Some(frame) = bytes.get(LEN_BYTES..LEN_BYTES + len) else {
        return Ok(None);
    };
    let shard = u32::from_be_bytes([frame[0], frame[1], frame[2], frame[3]]);
    let envelope = Envelope {
        shard,
        message: &frame[4..],
    };
    Ok(Some((envelope, LEN_BYTES + len)))
}

/// Why a message could not be encoded; nothing was appended.
#[derive(Debug)]
pub enum EncodeError {
    /// The envelope would exceed [`FRAME_BYTES_MAX`] (its `len`).
    TooLarge(usize),
    /// protobuf refused the message.
    Protobuf(protobuf::ProtobufError),
}

impl fmt::Display for EncodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            EncodeError::TooLarge(len) => {
                write!(f, "envelope of {len} bytes, the limit is {FRAME_BYTES_MAX}")
            }
            EncodeError::Protobuf(error) => write!(f, "protobuf: {error}"),
        }
    }
}

/// The envelope bytes `message` will take (header included), or why it cannot be sent.
pub fn encoded_len(message: &Message) -> Result<usize, EncodeError> {
    use protobuf::Message as _;
    let len = 4 + message.compute_size() as usize;
    if len > FRAME_BYTES_MAX {
        return Err(EncodeError::TooLarge(len));
    }
    Ok(LEN_BYTES + len)
}

/// Appends the envelope of `message` for `shard` to `out`; returns its length. On error `out`
/// is as it was.
pub fn encode(shard: u32, message: &Message, out: &mut Vec<u8>) -> Result<usize, EncodeError> {
    let total = encoded_len(message)?;
    let start = out.len();
    out.reserve(total);
    out.extend_from_slice(&((total - LEN_BYTES) as u32).to_be_bytes());
    out.extend_from_slice(&shard.to_be_bytes());
    if let Err(error) = write_cached(message, out) {
        out.truncate(start);
        return Err(EncodeError::Protobuf(error));
    }
    // compute_size and the write agree by protobuf's contract; a mismatch is a bug there.
    assert_eq!(
        out.len() - start,
        total,
        "protobuf wrote a size other than it computed"
    );
    Ok(total)
}

/// Appends `message` to `out` with the sizes `compute_size` cached (protobuf 2 does that only
/// through a stream).
fn write_cached(message: &Message, out: &mut Vec<u8>) -> protobuf::ProtobufResult<()> {
    use protobuf::Message as _;
    let mut stream = protobuf::CodedOutputStream::vec(out);
    message.write_to_with_cached_sizes(&mut stream)?;
    stream.flush()
}

#[cfg(test)]
#[path = "frame_tests.rs"]
mod tests;
