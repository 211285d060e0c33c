//! The fingerprint of a call's arguments: SHA-256 over a canonical JSON
//! document, so that "same key, other arguments" is detected.
//!
//! Canonical means object keys sorted at every depth, written by this module
//! rather than by `serde_json::to_string`: the order of a `HashMap`, and
//! whether some crate in the build enabled serde_json's `preserve_order`,
//! must not change the hash.

use serde::Serialize;
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::error::Error;

/// Collects the fingerprinted arguments of one call, by parameter name.
#[derive(Debug, Default)]
pub struct Fingerprint {
    args: Vec<(&'static str, Value)>,
    error: Option<serde_json::Error>,
}

impl Fingerprint {
    /// An empty fingerprint (a fn whose arguments are all skipped).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one argument.
    pub fn arg<T: Serialize + ?Sized>(mut self, name: &'static str, value: &T) -> Self {
        if self.error.is_none() {
            match serde_json::to_value(value) {
                Ok(v) => self.args.push((name, v)),
                Err(e) => self.error = Some(e),
            }
        }
        self
    }

    /// The lowercase hex SHA-256 of the canonical JSON object `{name: value, ...}`.
    pub fn finish(self) -> Result<String, Error> {
        if let Some(e) = self.error {
            return Err(Error::Serialize(e));
        }
        let object = Value::Object(self.args.into_iter().map(|(k, v)| (k.to_owned(), v)).collect());
        Ok(sha256_hex(canonical_json(&object).as_bytes()))
    }
}

/// JSON with object keys sorted (by bytes) at every depth and no whitespace.
pub fn canonical_json(value: &Value) -> String {
    let mut out = String::new();
    write_canonical(value, &mut out);
    out
}

fn write_canonical(value: &Value, out: &mut String) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push('{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(&Value::from(k.as_str()).to_string());
                out.push(':');
                write_canonical(v, out);
            }
            out.push('}');
        }
        Value::Array(items) => {
            out.push('[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(',');
                }
                write_canonical(v, out);
            }
            out.push(']');
        }
        scalar => out.push_str(&scalar.to_string()),
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    let digest = Sha256::digest(bytes);
    let mut hex = String::with_capacity(64);
    for b in digest.iter() {
        hex.push(char::from_digit(u32::from(b >> 4), 16).unwrap_or('0'));
        hex.push(char::from_digit(u32::from(b & 0xf), 16).unwrap_or('0'));
    }
    hex
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::{BTreeMap, HashMap};

    #[test]
    fn sorts_keys_at_every_depth() {
        let v: Value = serde_json::from_str(r#"{"b":1,"a":{"z":[{"y":1,"x":2}],"c":null}}"#).unwrap();
        assert_eq!(canonical_json(&v), r#"{"a":{"c":null,"z":[{"x":2,"y":1}]},"b":1}"#);
    }

    #[test]
    fn hashmap_order_does_not_matter() {
        let sorted: BTreeMap<String, i32> = (0..50).map(|i| (format!("k{i}"), i)).collect();
        let expected = Fingerprint::new().arg("m", &sorted).finish().unwrap();
        let mut orders = std::collections::HashSet::new();
        for _ in 0..20 {
            // Each HashMap gets a fresh random seed, hence its own iteration order.
            let m: HashMap<String, i32> = sorted.clone().into_iter().collect();
            orders.insert(m.keys().cloned().collect::<Vec<_>>());
            assert_eq!(Fingerprint::new().arg("m", &m).finish().unwrap(), expected);
        }
        assert!(orders.len() > 1, "the maps never iterated in different orders");
    }

    #[test]
    fn different_arguments_differ() {
        let a = Fingerprint::new().arg("amount", &1999).finish().unwrap();
        let b = Fingerprint::new().arg("amount", &2000).finish().unwrap();
        let c = Fingerprint::new().arg("other", &1999).finish().unwrap();
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
        assert_ne!(a, c);
    }

    #[test]
    fn unserializable_argument_is_an_error() {
        let mut m = HashMap::new();
        m.insert(vec![1u8], 1); // non-string map keys have no JSON form
        assert!(matches!(Fingerprint::new().arg("m", &m).finish(), Err(Error::Serialize(_))));
    }
}
