//! `--server a,b,c` (and `LATCHKEY_SERVER=a,b,c`): one server, or the members of a cluster.
//!
//! Each comma-separated item is `host:port` and resolves to one or more addresses; all of
//! them, without duplicates, are the client's members (at most [`MEMBERS_MAX`]). An error
//! names the item that is wrong. The admin commands (`stats`, `keys`, `cluster`) ask every
//! item once, each a member ([`parse_server_items`]). Deliberately not here: choosing a member
//! for a request (see the client).

use std::fmt;
use std::io;
use std::net::{SocketAddr, ToSocketAddrs};

use latchkey_client::MEMBERS_MAX;

/// An item of a `--server` list that does not give addresses, and why.
#[derive(Debug)]
pub struct ServerListError {
    /// The item as written (trimmed), or the whole list when it is empty.
    pub item: String,
    /// Why: `InvalidInput` for a malformed item or too many addresses, otherwise the
    /// resolver's error (`NotFound` for a name without addresses).
    pub error: io::Error,
}

impl fmt::Display for ServerListError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.item, self.error)
    }
}

impl std::error::Error for ServerListError {}

/// The addresses of every item of `list` (comma-separated `host:port`), in order and without
/// duplicates: at least one, at most [`MEMBERS_MAX`].
pub fn parse_servers(list: &str) -> Result<Vec<SocketAddr>, ServerListError> {
    let mut addrs: Vec<SocketAddr> = Vec::new();
    for item in list.split(',').map(str::trim) {
        let fail = |kind, message: &str| ServerListError {
            item: item.to_owned(),
            error: io::Error::new(kind, message.to_owned()),
        };
        if item.is_empty() {
            return Err(fail(
                io::ErrorKind::InvalidInput,
                "an empty item in the list",
            ));
        }
        let resolved = item.to_socket_addrs().map_err(|error| ServerListError {
            item: item.to_owned(),
            error,
        })?;
        let mut any = false;
        for addr in resolved {
            any = true;
            if !addrs.contains(&addr) {
                addrs.push(addr);
            }
            if addrs.len() > MEMBERS_MAX {
                let message = format!("more than {MEMBERS_MAX} addresses in the list");
                return Err(fail(io::ErrorKind::InvalidInput, &message));
            }
        }
        if !any {
            return Err(fail(io::ErrorKind::NotFound, "the name has no address"));
        }
    }
    Ok(addrs)
}

/// Each item of `list` as written (trimmed) with its addresses, in order: one item per member
/// for the admin commands, which ask every member once (an item whose name resolves to several
/// addresses is one member reached at the first that accepts). Items that repeat one another's
/// addresses are dropped; the same bounds and errors as [`parse_servers`].
pub fn parse_server_items(list: &str) -> Result<Vec<(String, Vec<SocketAddr>)>, ServerListError> {
    parse_servers(list)?;
    let mut items: Vec<(String, Vec<SocketAddr>)> = Vec::new();
    for item in list.split(',').map(str::trim) {
        let addrs = parse_servers(item)?;
        let seen = items
            .iter()
            .any(|(_, known)| addrs.iter().any(|addr| known.contains(addr)));
        if !seen {
            items.push((item.to_owned(), addrs));
        }
    }
    Ok(items)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_parses_in_order_without_duplicates() {
        let addrs = parse_servers("127.0.0.1:1, 127.0.0.2:2,127.0.0.1:1").unwrap();
        let expected: Vec<SocketAddr> = vec![
            "127.0.0.1:1".parse().unwrap(),
            "127.0.0.2:2".parse().unwrap(),
        ];
        assert_eq!(addrs, expected);
    }

    #[test]
    fn items_keep_their_addresses_together() {
        let items = parse_server_items("127.0.0.1:1, 127.0.0.2:2,127.0.0.1:1").unwrap();
        let names: Vec<&str> = items.iter().map(|(item, _)| item.as_str()).collect();
        assert_eq!(names, ["127.0.0.1:1", "127.0.0.2:2"]);
        assert_eq!(
            items[1].1,
            vec!["127.0.0.2:2".parse::<SocketAddr>().unwrap()]
        );
        let error = parse_server_items("127.0.0.1:1,no-port-here").unwrap_err();
        assert_eq!(error.item, "no-port-here");
    }

    #[test]
    fn a_bad_item_is_named() {
        let error = parse_servers("127.0.0.1:1,no-port-here").unwrap_err();
        assert_eq!(error.item, "no-port-here");
        assert_eq!(error.error.kind(), io::ErrorKind::InvalidInput);
        let error = parse_servers("127.0.0.1:1,,127.0.0.1:2").unwrap_err();
        assert_eq!(error.item, "");
        let many: Vec<String> = (1..=17).map(|port| format!("127.0.0.1:{port}")).collect();
        let error = parse_servers(&many.join(",")).unwrap_err();
        assert_eq!(error.item, "127.0.0.1:17");
    }
}
