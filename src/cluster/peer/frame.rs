//! The member ↔ member wire format: a hello, then envelopes. No I/O.
//!
//! A connection is one-way: the member that opened it writes, the other reads. It begins with a
//! [`Hello`] of [`HELLO_BYTES`] bytes:
//!
//! ```text
//! [magic "LKPR"][version u8][cluster shards u32 BE][from node id u64 BE]
//! ```
//!
//! then carries envelopes, each one raft message for one shard:
//!
//! ```text
//! [len u32 BE][shard u32 BE][protobuf bytes of raft::eraftpb::Message]
//! ```
//!
//! `len` counts the bytes after itself (the shard and the message), at least 4 and at most
//! [`FRAME_BYTES_MAX`]. [`decode`] checks the length before anything is allocated for it, and
//! borrows the message bytes from the caller's buffer ("incomplete" is `Ok(None)`).
//!
//! Deliberately not here: parsing the protobuf (the reader does it, so that a bad message closes
//! the connection like any other bad frame), sockets, and any reply channel (there is none).

use raft::eraftpb::Message;
use std::fmt;

/// The first four bytes of every peer connection.
pub const MAGIC: [u8; 4] = *b"LKPR";
/// The version of this wire format, in every hello.
pub const VERSION: u8 = 1;
/// Bytes in a hello: magic, version, shard count, node id.
pub const HELLO_BYTES: usize = 4 + 1 + 4 + 8;
/// Bytes of the `len` field that starts every envelope.
pub const LEN_BYTES: usize = 4;
/// Bytes before the message in an envelope: `len` and `shard`.
pub const HEADER_BYTES: usize = LEN_BYTES + 4;
/// The largest `len` accepted or sent: 16 MiB (shard and message). A bigger envelope closes the
/// connection that announced it; a bigger outgoing message is dropped and counted.
pub const FRAME_BYTES_MAX: usize = 16 << 20;

const _: () = assert!(FRAME_BYTES_MAX <= u32::MAX as usize);
const _: () = assert!(FRAME_BYTES_MAX > HEADER_BYTES);

/// The hello that opens a peer connection: who is writing, and for which cluster shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hello {
    /// The cluster's shard count, which must be the reader's own.
    pub shards: u32,
    /// The writing member's node id, which must be one of the reader's peers.
    pub node_id: u64,
}

/// Why a hello was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HelloError {
    /// The connection did not begin with [`MAGIC`] (these are the bytes it began with).
    Magic([u8; 4]),
    /// A version other than [`VERSION`].
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
}

impl fmt::Display for HelloError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HelloError::Magic(bytes) => write!(f, "bad magic {bytes:02x?} (not a latchkey peer)"),
            HelloError::Version(version) => {
                write!(
                    f,
                    "peer wire version {version}, this member speaks {VERSION}"
                )
            }
            HelloError::Shards { ours, theirs } => {
                write!(f, "peer has {theirs} shards, this member has {ours}")
            }
            HelloError::UnknownNode(id) => write!(f, "node id {id} is not a peer of this member"),
        }
    }
}

impl Hello {
    /// The hello's bytes.
    pub fn encode(&self) -> [u8; HELLO_BYTES] {
        let mut bytes = [0u8; HELLO_BYTES];
        bytes[..4].copy_from_slice(&MAGIC);
        bytes[4] = VERSION;
        bytes[5..9].copy_from_slice(&self.shards.to_be_bytes());
        bytes[9..].copy_from_slice(&self.node_id.to_be_bytes());
        bytes
    }

    /// Reads a hello from the start of `bytes` and checks it against the reader's shard count
    /// and peers (`known(id)`): `Ok(None)` until [`HELLO_BYTES`] bytes are there. Magic and
    /// version are checked as soon as their bytes arrive, so garbage is refused at once.
    pub fn decode(
        bytes: &[u8],
        shards: u32,
        known: impl Fn(u64) -> bool,
    ) -> Result<Option<Hello>, HelloError> {
        let magic_seen = bytes.len().min(MAGIC.len());
        if bytes[..magic_seen] != MAGIC[..magic_seen] {
            let mut magic = [0u8; 4];
            magic[..magic_seen].copy_from_slice(&bytes[..magic_seen]);
            return Err(HelloError::Magic(magic));
        }
        if let Some(&version) = bytes.get(4) {
            if version != VERSION {
                return Err(HelloError::Version(version));
            }
        }
        let Some(bytes) = bytes.get(..HELLO_BYTES) else {
            return Ok(None);
        };
        let theirs = u32::from_be_bytes([bytes[5], bytes[6], bytes[7], bytes[8]]);
        if theirs != shards {
            return Err(HelloError::Shards {
                ours: shards,
                theirs,
            });
        }
        let mut id = [0u8; 8];
        id.copy_from_slice(&bytes[9..]);
        let node_id = u64::from_be_bytes(id);
        if !known(node_id) {
            return Err(HelloError::UnknownNode(node_id));
        }
        Ok(Some(Hello { shards, node_id }))
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
