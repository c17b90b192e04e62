//! The one HTTP/1.1 request an admin session makes: its head parsed, its answer built. No I/O.

/// Longest request head accepted (request line and header fields, with the blank line).
pub const HEAD_BYTES_MAX: usize = 8 * 1024;
/// Most keys `GET /keys` lists.
pub const KEYS_LIMIT_MAX: usize = 10_000;
/// Keys `GET /keys` lists without `limit`.
pub const KEYS_LIMIT_DEFAULT: usize = 100;

/// What an admin request asks for.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Route {
    /// `GET /metrics`: Prometheus text.
    Metrics,
    /// `GET /stats`: the same figures as one JSON object.
    Stats,
    /// `GET /keys?prefix=P&limit=N`: held keys starting with `prefix`, at most `limit`.
    Keys {
        /// Keys listed start with these bytes.
        prefix: Vec<u8>,
        /// Keys listed at most (1..=[`KEYS_LIMIT_MAX`]).
        limit: usize,
    },
    /// `GET /health`: 200 while serving, 503 while shutting down.
    Health,
    /// `GET /cluster`: the server's card (`latchkey_client::card`): which cluster it is a
    /// member of, or that it is standalone. Needs no identity, like `/health`.
    Cluster,
    /// `GET /cluster/backup?shard=N`: a copy of shard N's locks, from the member that serves
    /// it (`crate::cluster::backup`).
    ClusterBackup {
        /// The shard.
        shard: u32,
    },
}

/// What the bytes read so far are.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Head {
    /// Not an HTTP request: the session speaks the lock protocol (or garbage), or has sent
    /// nothing yet.
    NotHttp,
    /// A beginning of `GET `: too early to tell.
    Prefix,
    /// `GET ` and an unfinished head.
    Incomplete,
    /// A whole head: the route, or the status and reason to refuse it with.
    Complete(Result<Route, Refusal>),
}

/// An HTTP error answer: status code and a one-line reason for the body.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Refusal {
    /// The status code.
    pub status: u16,
    /// Why, for the body.
    pub reason: &'static str,
}

impl Refusal {
    /// The head is longer than [`HEAD_BYTES_MAX`].
    pub const TOO_LARGE: Refusal = Refusal {
        status: 431,
        reason: "request head larger than 8 KiB",
    };
    /// The head did not come within the read deadline.
    pub const TIMEOUT: Refusal = Refusal {
        status: 408,
        reason: "request head not received in time",
    };
    /// Authorization rules are in force and no rule names the session's identity.
    pub const FORBIDDEN: Refusal = Refusal {
        status: 403,
        reason: "no [[auth.rule]] names this client's identity",
    };
    /// Too many admin requests at once on this core, or the figures did not come in time.
    pub const UNAVAILABLE: Refusal = Refusal {
        status: 503,
        reason: "too many admin requests at once; try again",
    };
}

/// The methods an admin request may use, each with the space after it: `HEAD` is answered as
/// `GET` without the body (a load balancer's probe). No op is `G` or `H`.
const METHODS: [&[u8]; 2] = [b"GET ", b"HEAD "];

/// Classifies the first bytes of a fresh session; a session whose first bytes are `GET ` or
/// `HEAD ` is an admin request (no op is `G` or `H`).
pub fn parse_head(bytes: &[u8]) -> Head {
    if bytes.is_empty() {
        return Head::NotHttp;
    }
    let starts = |method: &[u8]| {
        let known = bytes.len().min(method.len());
        bytes[..known] == method[..known]
    };
    if !METHODS.iter().any(|method| starts(method)) {
        return Head::NotHttp;
    }
    if !METHODS.iter().any(|method| bytes.starts_with(method)) {
        return Head::Prefix;
    }
    let Some(end) = head_end(bytes) else {
        if bytes.len() > HEAD_BYTES_MAX {
            return Head::Complete(Err(Refusal::TOO_LARGE));
        }
        return Head::Incomplete;
    };
    if end > HEAD_BYTES_MAX {
        return Head::Complete(Err(Refusal::TOO_LARGE));
    }
    let line_end = bytes.iter().position(|&b| b == b'\n').unwrap_or(end);
    let line = bytes[..line_end]
        .strip_suffix(b"\r")
        .unwrap_or(&bytes[..line_end]);
    Head::Complete(route_of(line))
}

/// Where the head ends (after its blank line), if it has.
fn head_end(bytes: &[u8]) -> Option<usize> {
    let limit = bytes.len().min(HEAD_BYTES_MAX + 4);
    (0..limit).find_map(|at| {
        let rest = &bytes[at..];
        if rest.starts_with(b"\r\n\r\n") {
            Some(at + 4)
        } else if rest.starts_with(b"\n\n") {
            Some(at + 2)
        } else {
            None
        }
    })
}

const BAD_REQUEST: Refusal = Refusal {
    status: 400,
    reason: "malformed request line",
};

/// Whether a request's first bytes are a `HEAD` request's: answered without a body.
pub fn is_head_only(bytes: &[u8]) -> bool {
    bytes.starts_with(b"HEAD ")
}

/// The route of a request line `GET <target> HTTP/1.x` (or `HEAD ...`).
fn route_of(line: &[u8]) -> Result<Route, Refusal> {
    let mut parts = line.split(|&b| b == b' ');
    let (Some(b"GET" | b"HEAD"), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(BAD_REQUEST);
    };
    if !version.starts_with(b"HTTP/1.") {
        return Err(BAD_REQUEST);
    }
    let (path, query) = match target.iter().position(|&b| b == b'?') {
        Some(at) => (&target[..at], &target[at + 1..]),
        None => (target, &b""[..]),
    };
    match path {
        b"/metrics" => Ok(Route::Metrics),
        b"/stats" => Ok(Route::Stats),
        b"/health" => Ok(Route::Health),
        b"/cluster" => Ok(Route::Cluster),
        b"/keys" => keys_route(query),
        b"/cluster/backup" => backup_route(query),
        _ => Err(Refusal {
            status: 404,
            reason: "no such page: try /metrics, /stats, /keys, /health, /cluster or \
                     /cluster/backup",
        }),
    }
}

fn keys_route(query: &[u8]) -> Result<Route, Refusal> {
    const BAD_LIMIT: Refusal = Refusal {
        status: 400,
        reason: "limit must be a number from 1 to 10000",
    };
    const BAD_ESCAPE: Refusal = Refusal {
        status: 400,
        reason: "malformed percent-escape in the query",
    };
    let mut prefix = Vec::new();
    let mut limit = KEYS_LIMIT_DEFAULT;
    for pair in query.split(|&b| b == b'&').filter(|pair| !pair.is_empty()) {
        let (name, value) = match pair.iter().position(|&b| b == b'=') {
            Some(at) => (&pair[..at], &pair[at + 1..]),
            None => (pair, &b""[..]),
        };
        let value = percent_decode(value).ok_or(BAD_ESCAPE)?;
        match name {
            b"prefix" => prefix = value,
            b"limit" => {
                limit = std::str::from_utf8(&value)
                    .ok()
                    .and_then(|text| text.parse().ok())
                    .filter(|limit| (1..=KEYS_LIMIT_MAX).contains(limit))
                    .ok_or(BAD_LIMIT)?;
            }
            _ => {}
        }
    }
    Ok(Route::Keys { prefix, limit })
}

fn backup_route(query: &[u8]) -> Result<Route, Refusal> {
    const BAD_SHARD: Refusal = Refusal {
        status: 400,
        reason: "shard must be given, a number (/cluster/backup?shard=N)",
    };
    let shard = (query.split(|&b| b == b'&'))
        .find_map(|pair| pair.strip_prefix(b"shard="))
        .and_then(|value| std::str::from_utf8(value).ok()?.parse().ok())
        .ok_or(BAD_SHARD)?;
    Ok(Route::ClusterBackup { shard })
}

/// Decodes `%XX` escapes and `+` (a space in a query); `None` on a malformed escape.
fn percent_decode(text: &[u8]) -> Option<Vec<u8>> {
    let mut out = Vec::with_capacity(text.len());
    let mut at = 0;
    while at < text.len() {
        match text[at] {
            b'%' => {
                let hex = text.get(at + 1..at + 3)?;
                let hex = std::str::from_utf8(hex).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                at += 3;
            }
            b'+' => {
                out.push(b' ');
                at += 1;
            }
            byte => {
                out.push(byte);
                at += 1;
            }
        }
    }
    Some(out)
}

/// The standard reason phrase (RFC 9110 §15) of every status the admin answers send; empty
/// (which HTTP/1.1 allows) for any other, rather than a wrong one.
fn reason_phrase(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        403 => "Forbidden",
        404 => "Not Found",
        408 => "Request Timeout",
        421 => "Misdirected Request",
        431 => "Request Header Fields Too Large",
        503 => "Service Unavailable",
        507 => "Insufficient Storage",
        _ => "",
    }
}

/// A whole HTTP/1.1 answer that closes the connection.
pub fn response(status: u16, content_type: &str, body: &[u8]) -> Vec<u8> {
    let reason = reason_phrase(status);
    let head = format!(
        "HTTP/1.1 {status} {reason}\r\nContent-Type: {content_type}\r\n\
         Content-Length: {}\r\nCache-Control: no-store\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let mut out = Vec::with_capacity(head.len() + body.len());
    out.extend_from_slice(head.as_bytes());
    out.extend_from_slice(body);
    out
}

/// `answer` (a whole [`response`]) without its body, for a `HEAD` request: the head, with the
/// `Content-Length` the body would have.
pub fn without_body(mut answer: Vec<u8>) -> Vec<u8> {
    if let Some(end) = answer.windows(4).position(|window| window == b"\r\n\r\n") {
        answer.truncate(end + 4);
    }
    answer
}

/// The answer to a refused request: its status and reason as plain text.
pub fn refusal_response(refusal: Refusal) -> Vec<u8> {
    let body = format!("{}\n", refusal.reason);
    response(refusal.status, "text/plain; charset=utf-8", body.as_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every status an admin answer can carry goes out with its standard phrase: the refusals
    /// here, the health page's 200 and 503, and the pages' 200.
    #[test]
    fn every_status_sent_has_its_standard_reason_phrase() {
        let refusals = [
            Refusal::TOO_LARGE,
            Refusal::TIMEOUT,
            Refusal::FORBIDDEN,
            Refusal::UNAVAILABLE,
            complete(b"GET /\r\n\r\n").unwrap_err(),
            complete(b"GET /nothing HTTP/1.1\r\n\r\n").unwrap_err(),
            complete(b"GET /keys?limit=0 HTTP/1.1\r\n\r\n").unwrap_err(),
        ];
        let mut sent: Vec<u16> = refusals.iter().map(|refusal| refusal.status).collect();
        sent.extend([200, 503, 421, 507]);
        let standard = [
            (200, "OK"),
            (400, "Bad Request"),
            (403, "Forbidden"),
            (404, "Not Found"),
            (408, "Request Timeout"),
            (421, "Misdirected Request"),
            (431, "Request Header Fields Too Large"),
            (503, "Service Unavailable"),
            (507, "Insufficient Storage"),
        ];
        for status in sent {
            let (_, phrase) = standard
                .iter()
                .find(|(code, _)| *code == status)
                .unwrap_or_else(|| panic!("status {status} is sent but has no phrase here"));
            let answer = String::from_utf8(response(status, "text/plain", b"")).unwrap();
            let line = answer.lines().next().unwrap();
            assert_eq!(line, format!("HTTP/1.1 {status} {phrase}"));
        }
        let answer = String::from_utf8(response(418, "text/plain", b"")).unwrap();
        assert!(answer.starts_with("HTTP/1.1 418 \r\n"), "{answer}");
    }

    fn complete(bytes: &[u8]) -> Result<Route, Refusal> {
        match parse_head(bytes) {
            Head::Complete(route) => route,
            other => panic!("not complete: {other:?}"),
        }
    }

    #[test]
    fn classifies_the_first_bytes() {
        assert_eq!(parse_head(b""), Head::NotHttp);
        assert_eq!(parse_head(b"G"), Head::Prefix);
        assert_eq!(parse_head(b"GET"), Head::Prefix);
        assert_eq!(parse_head(b"GET "), Head::Incomplete);
        assert_eq!(parse_head(b"GET /metrics HTTP/1.1\r\n"), Head::Incomplete);
        assert_eq!(parse_head(b"GX"), Head::NotHttp);
        assert_eq!(parse_head(b"A\x00\x01"), Head::NotHttp);
        assert_eq!(parse_head(b"POST /metrics HTTP/1.1\r\n\r\n"), Head::NotHttp);
        assert_eq!(parse_head(b"H"), Head::Prefix);
        assert_eq!(parse_head(b"HEAD"), Head::Prefix);
        assert_eq!(parse_head(b"HEAD "), Head::Incomplete);
        assert_eq!(parse_head(b"HEX"), Head::NotHttp);
        assert!(is_head_only(b"HEAD /health HTTP/1.1\r\n") && !is_head_only(b"GET /health "));
    }

    #[test]
    fn head_requests_route_as_get_and_are_answered_without_a_body() {
        let head = complete(b"HEAD /health HTTP/1.1\r\nHost: x\r\n\r\n");
        assert_eq!(head, Ok(Route::Health));
        let answer = without_body(response(200, "text/plain", b"serving\n"));
        let answer = String::from_utf8(answer).unwrap();
        assert!(answer.contains("Content-Length: 8\r\n"), "{answer}");
        assert!(answer.ends_with("\r\n\r\n"), "{answer}");
    }

    #[test]
    fn routes() {
        let get =
            |target: &str| complete(format!("GET {target} HTTP/1.1\r\nHost: x\r\n\r\n").as_bytes());
        assert_eq!(get("/metrics"), Ok(Route::Metrics));
        assert_eq!(get("/stats"), Ok(Route::Stats));
        assert_eq!(get("/health"), Ok(Route::Health));
        assert_eq!(get("/cluster"), Ok(Route::Cluster));
        let keys = |prefix: &[u8], limit| {
            Ok(Route::Keys {
                prefix: prefix.to_vec(),
                limit,
            })
        };
        assert_eq!(get("/keys"), keys(b"", 100));
        assert_eq!(get("/keys?prefix=jobs%2Fa+b&limit=7"), keys(b"jobs/a b", 7));
        assert_eq!(get("/keys?limit=10000&other=1"), keys(b"", 10_000));
        assert_eq!(get("/keys?limit=0").unwrap_err().status, 400);
        assert_eq!(get("/keys?limit=10001").unwrap_err().status, 400);
        assert_eq!(get("/keys?prefix=%zz").unwrap_err().status, 400);
        assert_eq!(get("/nope").unwrap_err().status, 404);
        let backup = get("/cluster/backup?shard=12");
        assert_eq!(backup, Ok(Route::ClusterBackup { shard: 12 }));
        assert_eq!(get("/cluster/backup").unwrap_err().status, 400);
        assert_eq!(get("/cluster/backup?shard=-1").unwrap_err().status, 400);
        assert_eq!(complete(b"GET /metrics\n\n").unwrap_err().status, 400);
        assert_eq!(complete(b"GET /metrics HTTP/1.0\n\n"), Ok(Route::Metrics));
    }

    #[test]
    fn a_head_over_8_kib_is_refused() {
        let mut head = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        head.resize(HEAD_BYTES_MAX + 1, b'a');
        assert_eq!(complete(&head), Err(Refusal::TOO_LARGE));
        head.extend_from_slice(b"\r\n\r\n");
        assert_eq!(complete(&head), Err(Refusal::TOO_LARGE));
        let mut fits = b"GET /metrics HTTP/1.1\r\nX: ".to_vec();
        fits.resize(HEAD_BYTES_MAX - 4, b'a');
        fits.extend_from_slice(b"\r\n\r\n");
        assert_eq!(complete(&fits), Ok(Route::Metrics));
    }

    #[test]
    fn answers_carry_length_and_close() {
        let answer = String::from_utf8(response(200, "text/plain", b"ok\n")).unwrap();
        assert!(answer.starts_with("HTTP/1.1 200 OK\r\n"));
        assert!(answer.contains("Content-Length: 3\r\n"));
        assert!(answer.contains("Connection: close\r\n"));
        assert!(answer.ends_with("\r\n\r\nok\n"));
    }
}
