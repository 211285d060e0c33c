//! Redis's replies to the stream commands, read into entries: `XREADGROUP`
//! (RESP2 arrays or a RESP3 map), `XAUTOCLAIM` and the extended `XPENDING`.
//! What a server sends is input: nothing here panics, an unreadable reply
//! is an `Err` with what was wrong, and an entry whose fields cannot be read
//! keeps its id with no fields (so it is dead-lettered as poison rather than
//! claimed forever).

use redis::Value;

/// One entry as Redis sent it: its id and its fields in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct RawEntry {
    pub(crate) id: String,
    pub(crate) fields: Vec<(Vec<u8>, Vec<u8>)>,
}

/// The entries of an `XREADGROUP` reply for one stream; none for a nil
/// reply (the block time passed).
pub(crate) fn entries_of_read_reply(reply: &Value) -> Result<Vec<RawEntry>, String> {
    match reply {
        Value::Nil => Ok(Vec::new()),
        // RESP2: [[stream, entries], ...]
        Value::Array(streams) => {
            let mut entries = Vec::new();
            for stream in streams {
                match stream {
                    Value::Array(pair) if pair.len() == 2 => entries.extend(entries_of(&pair[1])?),
                    other => return Err(format!("XREADGROUP: a stream's reply is not [name, entries]: {other:?}")),
                }
            }
            Ok(entries)
        }
        // RESP3: {stream: entries, ...}
        Value::Map(streams) => {
            let mut entries = Vec::new();
            for (_, stream_entries) in streams {
                entries.extend(entries_of(stream_entries)?);
            }
            Ok(entries)
        }
        other => Err(format!("XREADGROUP: unexpected reply {other:?}")),
    }
}

/// The next cursor and the entries of an `XAUTOCLAIM` reply (`[cursor,
/// entries, deleted ids]`; the last part is Redis 7's and ignored).
pub(crate) fn entries_of_autoclaim_reply(reply: &Value) -> Result<(String, Vec<RawEntry>), String> {
    match reply {
        Value::Array(parts) if parts.len() >= 2 => {
            let cursor =
                text(&parts[0]).ok_or_else(|| format!("XAUTOCLAIM: the cursor is not text: {:?}", parts[0]))?;
            Ok((cursor, entries_of(&parts[1])?))
        }
        other => Err(format!("XAUTOCLAIM: unexpected reply {other:?}")),
    }
}

/// `(id, times delivered)` of each row of an extended `XPENDING` reply
/// (`[[id, consumer, idle ms, delivered], ...]`).
pub(crate) fn delivery_counts_of_pending_reply(reply: &Value) -> Result<Vec<(String, u64)>, String> {
    let Value::Array(rows) = reply else {
        return Err(format!("XPENDING: unexpected reply {reply:?}"));
    };
    rows.iter()
        .map(|row| match row {
            Value::Array(cells) if cells.len() >= 4 => match (text(&cells[0]), number(&cells[3])) {
                (Some(id), Some(delivered)) => Ok((id, delivered)),
                _ => Err(format!("XPENDING: unreadable row {row:?}")),
            },
            _ => Err(format!("XPENDING: unreadable row {row:?}")),
        })
        .collect()
}

/// An array of `[id, [field, value, ...]]`; entries without a readable id
/// are left out (there is nothing to acknowledge them by).
fn entries_of(value: &Value) -> Result<Vec<RawEntry>, String> {
    let Value::Array(entries) = value else {
        return match value {
            Value::Nil => Ok(Vec::new()),
            other => Err(format!("entries are not an array: {other:?}")),
        };
    };
    let mut out = Vec::with_capacity(entries.len());
    for entry in entries {
        let Value::Array(parts) = entry else { continue };
        let Some(id) = parts.first().and_then(text) else { continue };
        let fields = parts.get(1).and_then(fields_of).unwrap_or_default();
        out.push(RawEntry { id, fields });
    }
    Ok(out)
}

/// `[field, value, ...]` (RESP2) or `{field: value}` (RESP3); `None` when
/// it is neither, or a name or a value is not a string.
fn fields_of(value: &Value) -> Option<Vec<(Vec<u8>, Vec<u8>)>> {
    match value {
        Value::Array(flat) if flat.len() % 2 == 0 => {
            flat.chunks_exact(2).map(|pair| Some((bytes(&pair[0])?, bytes(&pair[1])?))).collect()
        }
        Value::Map(pairs) => pairs.iter().map(|(k, v)| Some((bytes(k)?, bytes(v)?))).collect(),
        _ => None,
    }
}

fn bytes(value: &Value) -> Option<Vec<u8>> {
    match value {
        Value::BulkString(b) => Some(b.clone()),
        Value::SimpleString(s) => Some(s.as_bytes().to_vec()),
        _ => None,
    }
}

fn text(value: &Value) -> Option<String> {
    match value {
        Value::BulkString(b) => String::from_utf8(b.clone()).ok(),
        Value::SimpleString(s) => Some(s.clone()),
        _ => None,
    }
}

fn number(value: &Value) -> Option<u64> {
    match value {
        Value::Int(n) => u64::try_from(*n).ok(),
        other => text(other)?.parse().ok(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bulk(s: &str) -> Value {
        Value::BulkString(s.as_bytes().to_vec())
    }

    fn entry(id: &str, fields: &[&str]) -> Value {
        Value::Array(vec![bulk(id), Value::Array(fields.iter().map(|f| bulk(f)).collect())])
    }

    #[test]
    fn read_replies_in_resp2_and_resp3_give_the_same_entries() {
        let entries = Value::Array(vec![entry("1-0", &["payload", "{}", "message_id", "m"]), entry("2-0", &[])]);
        let resp2 = Value::Array(vec![Value::Array(vec![bulk("s"), entries.clone()])]);
        let resp3 = Value::Map(vec![(bulk("s"), entries)]);
        let expected = vec![
            RawEntry {
                id: "1-0".into(),
                fields: vec![(b"payload".to_vec(), b"{}".to_vec()), (b"message_id".to_vec(), b"m".to_vec())],
            },
            RawEntry { id: "2-0".into(), fields: vec![] },
        ];
        assert_eq!(entries_of_read_reply(&resp2).unwrap(), expected);
        assert_eq!(entries_of_read_reply(&resp3).unwrap(), expected);
        assert_eq!(entries_of_read_reply(&Value::Nil).unwrap(), vec![]);
    }

    #[test]
    fn autoclaim_and_pending_replies_are_read() {
        let reply =
            Value::Array(vec![bulk("0-0"), Value::Array(vec![entry("5-1", &["a", "b"])]), Value::Array(vec![])]);
        let (cursor, entries) = entries_of_autoclaim_reply(&reply).unwrap();
        assert_eq!((cursor.as_str(), entries.len(), entries[0].id.as_str()), ("0-0", 1, "5-1"));
        let pending = Value::Array(vec![Value::Array(vec![bulk("5-1"), bulk("c"), Value::Int(12), Value::Int(3)])]);
        assert_eq!(delivery_counts_of_pending_reply(&pending).unwrap(), vec![("5-1".to_owned(), 3)]);
    }

    #[test]
    fn malformed_replies_are_errors_and_malformed_entries_have_no_fields() {
        assert!(entries_of_read_reply(&Value::Int(1)).is_err());
        assert!(entries_of_read_reply(&Value::Array(vec![Value::Int(1)])).is_err());
        assert!(entries_of_autoclaim_reply(&Value::Array(vec![bulk("0-0")])).is_err());
        assert!(delivery_counts_of_pending_reply(&Value::Array(vec![Value::Array(vec![bulk("1-0")])])).is_err());
        // An odd field list, a field that is not a string, no id at all.
        let odd = Value::Array(vec![bulk("1-0"), Value::Array(vec![bulk("payload")])]);
        let not_string = Value::Array(vec![bulk("2-0"), Value::Array(vec![bulk("payload"), Value::Int(1)])]);
        let no_id = Value::Array(vec![Value::Int(7)]);
        let reply = Value::Array(vec![Value::Array(vec![bulk("s"), Value::Array(vec![odd, not_string, no_id])])]);
        let entries = entries_of_read_reply(&reply).unwrap();
        assert_eq!(
            entries,
            vec![RawEntry { id: "1-0".into(), fields: vec![] }, RawEntry { id: "2-0".into(), fields: vec![] }]
        );
    }
}
