//! Round trips counted on the wire: a client's *turn* is what it sends
//! before the server answers, and each turn is one round trip, whatever it
//! carries (one statement, a text of several, a prepared statement's
//! messages). The turns sqlx's pool sends when a connection comes back to
//! it are counted apart, as background: its check of the connection (a
//! ping), and the `ROLLBACK` a dropped transaction queued, which goes out
//! before that ping (MySQL: a turn of its own; PostgreSQL: in the ping's).

use std::sync::atomic::{AtomicU64, Ordering};

/// The wire protocol of the server behind a forwarder, as far as telling
/// the pool's turns from a caller's needs it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    /// MySQL and MariaDB: packets of a 3-byte length and a sequence byte;
    /// `COM_PING` is the one-byte payload `0x0e`, `COM_QUERY` starts `0x03`.
    MySql,
    /// PostgreSQL (plain TCP: `sslmode=disable`): after the startup, typed
    /// messages; sqlx pings with a lone `Sync`.
    Postgres,
}

/// Turns counted so far on every connection of one forwarder.
#[derive(Debug, Default)]
pub(super) struct Counts {
    statements: AtomicU64,
    background: AtomicU64,
}

/// What a forwarder counted.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Turns {
    /// Turns that carried a caller's statements: round trips it waited for.
    pub statements: u64,
    /// The pool's turns when a connection came back (a ping, and on MySQL
    /// the queued `ROLLBACK` before it): off the caller's path. On MySQL a
    /// lone `ROLLBACK` right before a ping looks the same whether a caller
    /// awaited it or the pool sent it; it is counted here.
    pub background: u64,
}

impl std::ops::Sub for Turns {
    type Output = Turns;
    fn sub(self, earlier: Turns) -> Turns {
        Turns { statements: self.statements - earlier.statements, background: self.background - earlier.background }
    }
}

impl Counts {
    pub(super) fn read(&self) -> Turns {
        Turns { statements: self.statements.load(Ordering::SeqCst), background: self.background.load(Ordering::SeqCst) }
    }
}

/// What one turn carried.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// A ping, maybe after simple queries queued in the same turn.
    Ping,
    /// MySQL: one `ROLLBACK` and nothing else.
    Rollback,
    Statement,
}

/// One connection's client side, framed into messages.
pub(super) struct Turn {
    protocol: Protocol,
    /// Bytes of a message not complete yet.
    partial: Vec<u8>,
    /// PostgreSQL: still in the startup (untyped messages).
    startup: bool,
    /// The open turn's messages so far (none: no turn open).
    messages: u32,
    /// Whether the open turn held anything but pings and simple queries,
    /// whether its last message pinged, whether it is one `ROLLBACK`.
    statement: bool,
    ends_in_ping: bool,
    rollback: bool,
    /// A MySQL `ROLLBACK` turn, counted once the next turn says whose it was.
    pending_rollback: bool,
}

impl Turn {
    pub(super) fn new(protocol: Protocol) -> Self {
        Turn {
            protocol,
            partial: Vec::new(),
            startup: true,
            messages: 0,
            statement: false,
            ends_in_ping: false,
            rollback: false,
            pending_rollback: false,
        }
    }

    /// Bytes the client sent.
    pub(super) fn sent(&mut self, bytes: &[u8]) {
        self.partial.extend_from_slice(bytes);
        while let Some(length) = self.next_length() {
            let message: Vec<u8> = self.partial.drain(..length).collect();
            self.message(&message);
        }
    }

    /// The server answered: the open turn, if any, ends and is counted.
    pub(super) fn answered(&mut self, counts: &Counts) {
        if self.messages == 0 {
            return;
        }
        let kind = if self.ends_in_ping && !self.statement {
            Kind::Ping
        } else if self.rollback && self.messages == 1 {
            Kind::Rollback
        } else {
            Kind::Statement
        };
        (self.messages, self.statement, self.ends_in_ping, self.rollback) = (0, false, false, false);
        if std::mem::take(&mut self.pending_rollback) {
            let whose = if kind == Kind::Ping { &counts.background } else { &counts.statements };
            whose.fetch_add(1, Ordering::SeqCst);
        }
        match kind {
            Kind::Ping => counts.background.fetch_add(1, Ordering::SeqCst),
            Kind::Rollback => {
                self.pending_rollback = true;
                0
            }
            Kind::Statement => counts.statements.fetch_add(1, Ordering::SeqCst),
        };
    }

    /// The length of the next whole message in `partial`, if it is all there.
    fn next_length(&self) -> Option<usize> {
        let p = &self.partial;
        let length = match self.protocol {
            Protocol::MySql if p.len() >= 4 => {
                4 + (usize::from(p[0]) | usize::from(p[1]) << 8 | usize::from(p[2]) << 16)
            }
            Protocol::Postgres if self.startup && p.len() >= 4 => u32::from_be_bytes([p[0], p[1], p[2], p[3]]) as usize,
            Protocol::Postgres if !self.startup && p.len() >= 5 => {
                1 + u32::from_be_bytes([p[1], p[2], p[3], p[4]]) as usize
            }
            _ => return None,
        };
        (p.len() >= length).then_some(length)
    }

    fn message(&mut self, message: &[u8]) {
        self.messages += 1;
        match self.protocol {
            Protocol::MySql => {
                // sqlx waits for a queued statement's answer before it
                // pings: a ping turn holds pings only.
                let payload = &message[4..];
                let ping = payload == [0x0e];
                self.ends_in_ping = ping;
                self.statement |= !ping;
                self.rollback = payload == b"\x03ROLLBACK";
            }
            Protocol::Postgres if self.startup => {
                // SSLRequest and GSSENCRequest come before the startup
                // message (protocol 3.0), which ends the untyped part.
                let code = message.get(4..8).map(|c| u32::from_be_bytes([c[0], c[1], c[2], c[3]]));
                self.startup = code != Some(0x0003_0000);
                self.statement = true;
            }
            Protocol::Postgres => {
                let kind = message[0];
                self.ends_in_ping = kind == b'S';
                // A simple query followed by a Sync in one turn is the
                // pool's rollback of a dropped transaction and its ping;
                // a simple query alone ends its turn without a Sync.
                self.statement |= !matches!(kind, b'S' | b'Q');
            }
        }
    }
}
