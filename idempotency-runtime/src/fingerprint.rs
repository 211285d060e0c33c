//! The fingerprint of a call's arguments: SHA-256 over a canonical JSON
//! document, so that "same key, other arguments" is detected.
//!
//! Canonical means object keys sorted at every depth, written by this module
//! ([`canonical`]) rather than by `serde_json::to_string`: the order of a
//! `HashMap`, and whether some crate in the build enabled serde_json's
//! `preserve_order`, must not change the hash.
//!
//! `-0.0` is written `0.0`: the two are equal as values, and equal values
//! fingerprint alike.
//!
//! A float that is NaN or infinite is refused ([`Error::NonFiniteFloat`]):
//! serde_json writes all three as `null`, so `Some(f64::NAN)`,
//! `Some(f64::INFINITY)` and `None` would share a fingerprint and replay each
//! other's results. The writer checks every float it writes, at any depth.

use serde::Serialize;
use sha2::{Digest, Sha256};

use crate::error::Error;

mod canonical;

use canonical::{Object, Writer};

/// Collects the fingerprinted arguments of one call, by parameter name:
/// the canonical document `{name: value, ...}`, written as they come.
#[derive(Debug, Default)]
pub struct Fingerprint {
    /// The document's object, open until [`finish`](Self::finish).
    doc: Writer,
    error: Option<Error>,
}

/// What an argument of an `#[idempotent]` fn must be: serialized into the
/// call's fingerprint, which tells a retry from a new request.
#[diagnostic::on_unimplemented(
    message = "the argument `{Self}` cannot be fingerprinted by #[idempotent]",
    label = "an argument must implement `serde::Serialize`: the fingerprint tells a retry from another request",
    note = "derive `serde::Serialize` for `{Self}`, or mark the parameter `#[idem(skip)]` when it does not decide what the call does (a client, a config, a counter)"
)]
pub trait Fingerprinted: Serialize {}

impl<T: Serialize + ?Sized> Fingerprinted for T {}

impl Fingerprint {
    /// An empty fingerprint (a fn whose arguments are all skipped).
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one argument. An argument that does not serialize, or holds a
    /// NaN or infinite float anywhere, makes [`finish`](Self::finish) fail.
    pub fn arg<T: Fingerprinted + ?Sized>(mut self, name: &'static str, value: &T) -> Self {
        self.add(name, value);
        self
    }

    /// Adds one argument marked `#[idem(skip_if_default)]`: left out of the
    /// document when its JSON is the JSON of `T::default()` (`None`, `0`,
    /// `false`, `""`, empty), so an argument added to a fn keeps the
    /// fingerprints of the calls made before it existed. Compared as
    /// canonical bytes: what the fingerprint would hash.
    pub fn arg_unless_default<T: Fingerprinted + Default>(mut self, name: &'static str, value: &T) -> Self {
        if !self.add(name, value) {
            return self;
        }
        let mut default = Writer::default();
        let is_default =
            T::default().serialize(&mut default).is_ok() && !default.non_finite && default.out == self.doc.last_value();
        if is_default {
            self.doc.drop_last(ROOT);
        }
        self
    }

    /// Writes `name: value` into the document; false (the first error
    /// noted) when it cannot.
    fn add<T: Serialize + ?Sized>(&mut self, name: &'static str, value: &T) -> bool {
        if self.error.is_some() {
            return false;
        }
        if self.doc.out.is_empty() {
            self.doc.reserve();
            self.doc.begin_object();
        }
        let written = self.doc.field(ROOT, name, value);
        // Checked even on `Ok`: a `Serialize` impl that swallowed our
        // refusal must not get the `null` through.
        match written {
            _ if self.doc.non_finite => self.error = Some(Error::NonFiniteFloat { arg: name }),
            Ok(()) => return true,
            Err(e) => self.error = Some(Error::Serialize(e)),
        }
        false
    }

    /// The lowercase hex SHA-256 of the canonical JSON object `{name: value, ...}`
    /// (the last of equal names counting).
    pub fn finish(self) -> Result<String, Error> {
        self.finish_hex().map(|hex| hex.as_str().to_owned())
    }

    /// [`finish`](Self::finish), the digits held inline ([`Hex`]).
    pub(crate) fn finish_hex(self) -> Result<Hex, Error> {
        let doc = self.written()?;
        let hex = Hex::of_bytes(&Sha256::digest(&doc.out));
        doc.recycle();
        Ok(hex)
    }

    /// The canonical document itself.
    #[cfg(test)]
    fn document(self) -> Result<Vec<u8>, Error> {
        self.written().map(|doc| doc.out)
    }

    /// The document, closed.
    fn written(self) -> Result<Writer, Error> {
        if let Some(e) = self.error {
            return Err(e);
        }
        let mut doc = self.doc;
        if doc.out.is_empty() {
            doc.begin_object();
        }
        doc.end_object(ROOT);
        Ok(doc)
    }
}

/// The document's own object: first in the buffer, its entries the arguments.
const ROOT: Object = Object::ROOT;

/// JSON with object keys sorted (by bytes) at every depth and no whitespace.
#[cfg(any(test, fuzzing))]
pub(crate) fn canonical_json(value: &serde_json::Value) -> String {
    let mut doc = Writer::default();
    value.serialize(&mut doc).expect("a JSON value writes");
    String::from_utf8(doc.out).expect("serde_json writes UTF-8")
}

/// A fingerprint as text: the 64 lowercase hex digits of a SHA-256, or the
/// digits of a stored prefix of one (a Redis result keeps 16 bytes), held
/// inline, so a call and its replay copy it without allocating.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(crate) struct Hex {
    len: u8,
    digits: [u8; 64],
}

impl Hex {
    /// The digits of at most 32 `bytes` (the rest is cut).
    pub(crate) fn of_bytes(bytes: &[u8]) -> Hex {
        let bytes = &bytes[..bytes.len().min(32)];
        let mut digits = [0; 64];
        write_lower_hex(&mut digits, bytes);
        Hex { len: 2 * bytes.len() as u8, digits }
    }

    /// A fingerprint stored as text (a record's `params_hash`). Text no
    /// fingerprint can be (longer than 64 bytes, not ASCII) reads as empty,
    /// which no call's fingerprint equals: it answers `KeyReused`, as it did.
    pub(crate) fn stored(text: &str) -> Hex {
        let mut digits = [0; 64];
        if text.len() > digits.len() || !text.is_ascii() {
            return Hex { len: 0, digits };
        }
        digits[..text.len()].copy_from_slice(text.as_bytes());
        Hex { len: text.len() as u8, digits }
    }

    pub(crate) fn as_str(&self) -> &str {
        std::str::from_utf8(&self.digits[..usize::from(self.len)]).expect("ASCII by construction")
    }
}

impl std::ops::Deref for Hex {
    type Target = str;

    fn deref(&self) -> &str {
        self.as_str()
    }
}

impl std::fmt::Debug for Hex {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        std::fmt::Debug::fmt(self.as_str(), f)
    }
}

pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    let mut hex = String::with_capacity(64);
    push_lower_hex(&mut hex, &Sha256::digest(bytes));
    hex
}

/// Appends `bytes` as lowercase hex, two digits each: written into a
/// stack buffer, not a `char` at a time (this runs on every call, twice).
pub(crate) fn push_lower_hex(out: &mut String, bytes: &[u8]) {
    out.reserve(bytes.len() * 2);
    for chunk in bytes.chunks(32) {
        let mut buf = [0u8; 64];
        let hex = &mut buf[..chunk.len() * 2];
        write_lower_hex(hex, chunk);
        out.push_str(std::str::from_utf8(hex).expect("hex digits are ASCII"));
    }
}

/// Writes `bytes` as lowercase hex into `out` (twice their length; digits
/// past the shorter of the two are left as they are).
pub(crate) fn write_lower_hex(out: &mut [u8], bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    for (pair, b) in out.chunks_exact_mut(2).zip(bytes) {
        pair[0] = DIGITS[usize::from(b >> 4)];
        pair[1] = DIGITS[usize::from(b & 0xf)];
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::Value;
    use std::collections::{BTreeMap, HashMap};

    #[test]
    fn digits_held_inline_read_as_the_text_they_replace() {
        let digest = Sha256::digest(b"{}");
        assert_eq!(Hex::of_bytes(&digest).as_str(), sha256_hex(b"{}"));
        assert_eq!(Hex::of_bytes(&digest[..16]).as_str(), &sha256_hex(b"{}")[..32]);
        let finished = Fingerprint::new().arg("a", &1).finish_hex().unwrap();
        assert_eq!(finished.as_str(), Fingerprint::new().arg("a", &1).finish().unwrap());
        assert_eq!(Hex::stored(finished.as_str()), finished);
        // Stored text no fingerprint can be matches none.
        assert_eq!(Hex::stored(&"f".repeat(65)).as_str(), "");
        assert_eq!(Hex::stored("é").as_str(), "");
    }

    /// The document as it was written before the writer (a JSON value
    /// built, then walked with its keys sorted): what stored fingerprints
    /// hashed, and what the writer must write byte for byte.
    fn walked(value: &Value, out: &mut Vec<u8>) {
        match value {
            Value::Object(map) => {
                let mut entries: Vec<_> = map.iter().collect();
                entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
                out.push(b'{');
                for (i, (k, v)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    serde_json::to_writer(&mut *out, k).unwrap();
                    out.push(b':');
                    walked(v, out);
                }
                out.push(b'}');
            }
            Value::Array(items) => {
                out.push(b'[');
                for (i, v) in items.iter().enumerate() {
                    if i > 0 {
                        out.push(b',');
                    }
                    walked(v, out);
                }
                out.push(b']');
            }
            Value::Number(n) if n.as_f64().is_some_and(|x| x == 0.0 && x.is_sign_negative()) => {
                out.extend_from_slice(b"0.0")
            }
            scalar => serde_json::to_writer(&mut *out, scalar).unwrap(),
        }
    }

    /// Asserts that the writer writes `value` (an argument named `v`) as
    /// the walk of its JSON value wrote it.
    #[track_caller]
    fn writes_as_walked<T: Serialize + ?Sized>(value: &T) {
        let mut expected = Vec::new();
        walked(&serde_json::json!({ "v": serde_json::to_value(value).unwrap() }), &mut expected);
        let written = Fingerprint::new().arg("v", value).document().unwrap();
        assert_eq!(String::from_utf8(written).unwrap(), String::from_utf8(expected).unwrap());
    }

    /// A thread's next fingerprint reuses the last one's buffers: what it
    /// hashes is its own document, however long the last one was and in
    /// whatever order its entries came.
    #[test]
    fn a_reused_buffer_holds_nothing_of_the_last_document() {
        let long = "x".repeat(3000);
        let first = Fingerprint::new().arg("z", &long).arg("a", &[3, 2, 1]).finish().unwrap();
        let short = Fingerprint::new().arg("k", &1).finish().unwrap();
        assert_eq!(short, sha256_hex(br#"{"k":1}"#));
        assert_eq!(Fingerprint::new().arg("z", &long).arg("a", &[3, 2, 1]).finish().unwrap(), first);
        // A document over the kept size is let go, and the next one is still right.
        let huge = "y".repeat(64 * 1024);
        Fingerprint::new().arg("h", &huge).finish().unwrap();
        assert_eq!(Fingerprint::new().arg("k", &1).finish().unwrap(), short);
    }

    /// Field names renamed to what needs escaping sort by their characters
    /// and are written as the walk wrote them.
    #[test]
    fn renamed_fields_are_escaped_and_sorted_as_before() {
        #[derive(Serialize)]
        struct Renamed {
            plain_1: u8,
            #[serde(rename = "a-b")]
            dashed: u8,
            #[serde(rename = "q\"uote")]
            quoted: u8,
            #[serde(rename = "caf\u{e9}")]
            accented: u8,
            #[serde(rename = "tab\t")]
            tab: u8,
            #[serde(rename = "")]
            empty: u8,
            #[serde(rename = "Z")]
            upper: u8,
        }
        let value = Renamed { plain_1: 1, dashed: 2, quoted: 3, accented: 4, tab: 5, empty: 6, upper: 7 };
        writes_as_walked(&value);
        let doc = Fingerprint::new().arg("v", &value).document().unwrap();
        let expected = r#"{"v":{"":6,"Z":7,"a-b":2,"café":4,"plain_1":1,"q\"uote":3,"tab\t":5}}"#;
        assert_eq!(String::from_utf8(doc).unwrap(), expected);
    }

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

    /// Stored records carry fingerprints: the bytes hashed never change.
    #[test]
    fn the_hashed_document_is_stable() {
        #[derive(Serialize)]
        struct Order<'a> {
            zeta: Option<u8>,
            alpha: &'a str,
            lines: Vec<(i64, f64)>,
            tags: BTreeMap<&'a str, bool>,
        }
        let tags = BTreeMap::from([("vip", true), ("a\"b", false)]);
        let order =
            Order { zeta: None, alpha: "caf\u{e9} \"\\\n\u{1}", lines: vec![(-3, 0.5), (i64::MAX, 1e300)], tags };
        let mut fingerprint = Fingerprint::new().arg("order", &order).arg("amount", &u64::MAX).arg("note", "n\u{f6}te");
        fingerprint = fingerprint.arg("b", &()).arg("a", &[1.25f32]);
        assert_eq!(fingerprint.finish().unwrap(), "823d0ad6ce4d31cd78f08898bd03253d82fe87627ccd24c03415362bf21b8ace");
    }

    /// Records stored before an argument was added hold the document
    /// without it: the marked argument at its default hashes to those very
    /// bytes (the pinned hash of `{"amount":1999,"order_id":42}`).
    #[test]
    fn a_marked_argument_at_its_default_keeps_the_old_document() {
        let before = Fingerprint::new().arg("order_id", &42).arg("amount", &1999).finish().unwrap();
        assert_eq!(before, "a915d01e33af3472eeccfbfd8e2298c42524ad783f33d0d3b36f8e13fc05c554");
        let after = |coupon: &Option<&str>, express: &bool, note: &String| {
            Fingerprint::new()
                .arg("order_id", &42)
                .arg_unless_default("coupon", coupon)
                .arg("amount", &1999)
                .arg_unless_default("express", express)
                .arg_unless_default("note", note)
                .finish()
                .unwrap()
        };
        assert_eq!(after(&None, &false, &String::new()), before);
        // Set, each counts, and differs from the unmarked `null` too.
        let with_coupon = after(&Some("SPRING"), &false, &String::new());
        assert_eq!(with_coupon, sha256_hex(br#"{"amount":1999,"coupon":"SPRING","order_id":42}"#));
        let null_coupon = Fingerprint::new().arg("order_id", &42).arg("coupon", &None::<&str>).arg("amount", &1999);
        assert_ne!(null_coupon.finish().unwrap(), before, "unmarked, `None` is in the document as null");
        assert_eq!(after(&None, &true, &String::new()), sha256_hex(br#"{"amount":1999,"express":true,"order_id":42}"#));
        assert_eq!(after(&None, &false, &"n".into()), sha256_hex(br#"{"amount":1999,"note":"n","order_id":42}"#));
    }

    /// Left out means equal as canonical bytes: `-0.0` is `0.0` there (so
    /// left out too), `0.5` is not, and a struct is left out only whole.
    #[test]
    fn only_the_exact_default_is_left_out() {
        #[derive(Default, Serialize)]
        struct Extra {
            gift: Option<String>,
            count: u32,
        }
        let without = Fingerprint::new().arg("k", &1).finish().unwrap();
        let with = |x: &f64| Fingerprint::new().arg("k", &1).arg_unless_default("x", x).finish().unwrap();
        assert_eq!(with(&0.0), without);
        assert_eq!(with(&-0.0), without);
        assert_ne!(with(&-0.0), with(&0.5));
        let extra = |e: &Extra| Fingerprint::new().arg("k", &1).arg_unless_default("e", e).finish().unwrap();
        assert_eq!(extra(&Extra::default()), without);
        let counted = extra(&Extra { gift: None, count: 1 });
        assert_eq!(counted, sha256_hex(br#"{"e":{"count":1,"gift":null},"k":1}"#), "inside a value, null stays");
        // A refusal is a refusal, marked or not.
        assert_eq!(refused(Fingerprint::new().arg_unless_default("rate", &Some(f64::NAN))), "rate");
        assert_eq!(refused(Fingerprint::new().arg_unless_default("rate", &f64::INFINITY)), "rate");
    }

    /// Regression (found by fuzzing: `fuzz/`, target `canonical_json`):
    /// `-0.0` and `0.0` are equal as values (serde_json's `Value`, and
    /// `f64`), but were written `-0.0` and `0.0`: the same arguments had two
    /// fingerprints, and a retry could be refused as another request.
    #[test]
    fn negative_zero_is_zero() {
        let zero = Fingerprint::new().arg("amount", &0.0).finish().unwrap();
        assert_eq!(Fingerprint::new().arg("amount", &-0.0).finish().unwrap(), zero);
        assert_eq!(Fingerprint::new().arg("amount", &-0.0f32).finish().unwrap(), zero);
        let nested = serde_json::json!({ "lines": [{ "price": -0.0 }] });
        assert_eq!(canonical_json(&nested), r#"{"lines":[{"price":0.0}]}"#);
        // Still apart from the integer 0, which is another value.
        assert_ne!(Fingerprint::new().arg("amount", &0).finish().unwrap(), zero);
    }

    #[test]
    fn a_name_given_twice_keeps_its_last_value() {
        let twice = Fingerprint::new().arg("b", &0).arg("a", &1).arg("b", &2).finish().unwrap();
        assert_eq!(twice, Fingerprint::new().arg("a", &1).arg("b", &2).finish().unwrap());
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

    fn refused(fingerprint: Fingerprint) -> &'static str {
        match fingerprint.finish() {
            Err(Error::NonFiniteFloat { arg }) => arg,
            other => panic!("not refused as non-finite: {other:?}"),
        }
    }

    /// Regression: `Some(NaN)`, `Some(inf)` and `None` all serialized to
    /// `null`, so they shared a fingerprint and replayed each other.
    #[test]
    fn non_finite_floats_are_refused_not_written_as_null() {
        for x in [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, -f64::NAN] {
            assert_eq!(refused(Fingerprint::new().arg("amount", &x)), "amount", "{x}");
            assert_eq!(refused(Fingerprint::new().arg("amount", &Some(x))), "amount", "{x}");
        }
        for x in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            assert_eq!(refused(Fingerprint::new().arg("rate", &x)), "rate", "{x}");
            assert_eq!(refused(Fingerprint::new().arg("rate", &Some(x))), "rate", "{x}");
        }
        let none = Fingerprint::new().arg("amount", &None::<f64>).finish().unwrap();
        assert_eq!(none, Fingerprint::new().arg("amount", &()).finish().unwrap(), "None is null");
    }

    #[derive(Serialize)]
    struct Line {
        sku: String,
        price: f64,
        discount: Option<f32>,
    }

    #[derive(Serialize)]
    enum Adjust {
        Unit,
        Newtype(f64),
        Tuple(u8, f32),
        Struct { by: f64 },
    }

    #[derive(Serialize)]
    struct Wrapper(f64);

    #[derive(Serialize)]
    struct Pair(u8, f64);

    #[test]
    fn non_finite_floats_are_found_at_any_depth() {
        let line = |price, discount| Line { sku: "a".into(), price, discount };
        let order = |lines| -> BTreeMap<&str, Vec<Line>> { BTreeMap::from([("lines", lines)]) };
        let nan = f64::NAN;
        let cases: Vec<Fingerprint> = vec![
            Fingerprint::new().arg("line", &line(nan, None)),
            Fingerprint::new().arg("line", &line(1.0, Some(f32::INFINITY))),
            Fingerprint::new().arg("lines", &vec![line(1.0, None), line(f64::NEG_INFINITY, None)]),
            Fingerprint::new().arg("order", &order(vec![line(1.0, Some(0.5)), line(2.0, Some(f32::NAN))])),
            Fingerprint::new().arg("prices", &HashMap::from([("a", 1.0), ("b", nan)])),
            Fingerprint::new().arg("pair", &(1u8, [0.5, f64::INFINITY])),
            Fingerprint::new().arg("adjust", &Adjust::Newtype(nan)),
            Fingerprint::new().arg("adjust", &Adjust::Tuple(1, f32::NEG_INFINITY)),
            Fingerprint::new().arg("adjust", &Adjust::Struct { by: nan }),
            Fingerprint::new().arg("wrapper", &Wrapper(f64::INFINITY)),
            Fingerprint::new().arg("pair", &Pair(1, nan)),
            Fingerprint::new().arg("nested", &Some(Some(vec![Some(nan)]))),
        ];
        let names = [
            "line", "line", "lines", "order", "prices", "pair", "adjust", "adjust", "adjust", "wrapper", "pair",
            "nested",
        ];
        for (fingerprint, name) in cases.into_iter().zip(names) {
            assert_eq!(refused(fingerprint), name);
        }
    }

    #[test]
    fn the_argument_holding_it_is_named_and_the_first_refusal_wins() {
        let fingerprint = Fingerprint::new()
            .arg("order_id", &42)
            .arg("amount", &f64::NAN)
            .arg("rate", &f32::INFINITY)
            .arg("m", &HashMap::from([(vec![1u8], 1)]));
        assert_eq!(refused(fingerprint), "amount");
        let unserializable_first =
            Fingerprint::new().arg("m", &HashMap::from([(vec![1u8], 1)])).arg("amount", &f64::NAN);
        assert!(matches!(unserializable_first.finish(), Err(Error::Serialize(_))));
    }

    #[test]
    fn finite_floats_and_everything_else_serialize_as_serde_json_would() {
        #[derive(Serialize)]
        struct All {
            floats: Vec<f64>,
            small: Vec<f32>,
            line: Line,
            adjust: Vec<Adjust>,
            wrapper: Wrapper,
            pair: Pair,
            big: (u128, i128),
            text: (char, &'static str, ()),
            bytes: &'static [u8],
            map: BTreeMap<u32, Option<f64>>,
        }
        let all = All {
            floats: vec![0.0, -0.0, 1.5, -2.25, f64::MAX, f64::MIN, f64::MIN_POSITIVE, 5e-324, f64::EPSILON],
            small: vec![0.1, f32::MAX, f32::MIN_POSITIVE, -1e-45],
            line: Line { sku: "é\u{0}\"".into(), price: 19.99, discount: None },
            adjust: vec![Adjust::Unit, Adjust::Newtype(1.0), Adjust::Tuple(2, 3.5), Adjust::Struct { by: -4.0 }],
            wrapper: Wrapper(0.5),
            pair: Pair(7, 8.0),
            big: (u128::from(u64::MAX), i128::from(i64::MIN)),
            text: ('x', "y", ()),
            bytes: b"\x00\xff",
            map: BTreeMap::from([(1, Some(1e300)), (2, None)]),
        };
        let expected = serde_json::to_value(&all).unwrap();
        let got = Fingerprint::new().arg("all", &all);
        writes_as_walked(&all);
        let direct = sha256_hex(canonical_json(&serde_json::json!({ "all": expected })).as_bytes());
        assert_eq!(got.finish().unwrap(), direct);
        for x in [0.0, -0.0, 1e-310, f64::MAX] {
            Fingerprint::new().arg("x", &x).finish().unwrap();
        }
    }

    #[test]
    fn unserializable_argument_is_an_error() {
        let mut m = HashMap::new();
        m.insert(vec![1u8], 1); // non-string map keys have no JSON form
        assert!(matches!(Fingerprint::new().arg("m", &m).finish(), Err(Error::Serialize(_))));
    }
    /// A tree whose maps are serialized in the order given, repeated keys
    /// and all: the writer's reordering against a JSON value's sorted map.
    enum Tree {
        Map(Vec<(String, Tree)>),
        List(Vec<Tree>),
        Leaf(Value),
    }

    impl Serialize for Tree {
        fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            match self {
                Tree::Map(entries) => serializer.collect_map(entries.iter().map(|(k, v)| (k, v))),
                Tree::List(items) => serializer.collect_seq(items),
                Tree::Leaf(value) => value.serialize(serializer),
            }
        }
    }

    /// xorshift64: the same trees on every run.
    struct Rng(u64);

    impl Rng {
        fn below(&mut self, n: u64) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0 % n
        }

        /// Keys from characters whose escaped and raw orders differ.
        fn key(&mut self) -> String {
            const CHARS: [char; 9] = ['"', '\\', 'A', 'a', '\u{e9}', '\u{1}', '\u{7f}', '~', '\u{1f600}'];
            (0..self.below(3)).map(|_| CHARS[self.below(CHARS.len() as u64) as usize]).collect()
        }

        fn tree(&mut self, depth: u32) -> Tree {
            let kind = if depth >= 4 { self.below(2) + 2 } else { self.below(4) };
            match kind {
                0 => Tree::Map((0..self.below(6)).map(|_| (self.key(), self.tree(depth + 1))).collect()),
                1 => Tree::List((0..self.below(4)).map(|_| self.tree(depth + 1)).collect()),
                2 => Tree::Leaf(Value::from(self.below(u64::MAX) as i64)),
                _ => Tree::Leaf(match self.below(5) {
                    0 => Value::Null,
                    1 => Value::from(-0.0),
                    2 => Value::from(f64::from_bits(self.below(0x7fe0_0000_0000_0000))),
                    3 => Value::from(self.key()),
                    _ => Value::from(self.below(2) == 0),
                }),
            }
        }
    }

    #[test]
    fn writes_what_the_walk_of_a_json_value_wrote() {
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..3000 {
            writes_as_walked(&rng.tree(0));
        }
    }

    /// Keys compare raw: `"` is before `A`, though its escape `\"` is after.
    #[test]
    fn keys_sort_by_their_unescaped_bytes() {
        let tree = Tree::Map(vec![
            ("A".into(), Tree::Leaf(1.into())),
            ("\"".into(), Tree::Leaf(2.into())),
            ("\u{1}".into(), Tree::Leaf(3.into())),
            ("A".into(), Tree::Leaf(4.into())),
        ]);
        let written = Fingerprint::new().arg("v", &tree).document().unwrap();
        assert_eq!(String::from_utf8(written).unwrap(), r#"{"v":{"\u0001":3,"\"":2,"A":4}}"#);
        writes_as_walked(&tree);
    }

    #[derive(Serialize, PartialEq, Eq, PartialOrd, Ord)]
    enum Side {
        Buy,
        Sell,
    }

    #[derive(Serialize, PartialEq, Eq, PartialOrd, Ord)]
    struct Sku(u32);

    /// Floats as keys, in a map serialized from pairs.
    struct FloatKeys(Vec<(f32, f64)>);

    impl Serialize for FloatKeys {
        fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            serializer.collect_map(self.0.iter().map(|(k, v)| (k, v)))
        }
    }

    #[test]
    fn map_keys_are_written_as_a_json_value_keys_them() {
        writes_as_walked(&BTreeMap::from([(-3i64, 1), (20, 2), (100, 3)]));
        writes_as_walked(&BTreeMap::from([(u128::MAX, 1), (0, 2)]));
        writes_as_walked(&BTreeMap::from([(true, 1), (false, 2)]));
        writes_as_walked(&BTreeMap::from([('"', 1), ('z', 2)]));
        writes_as_walked(&BTreeMap::from([(Side::Sell, 1), (Side::Buy, 2)]));
        writes_as_walked(&BTreeMap::from([(Sku(10), 1), (Sku(9), 2)]));
        writes_as_walked(&FloatKeys(vec![(0.1, 0.1), (-0.0, -0.0), (1e30, 2.5)]));
        assert_eq!(refused(Fingerprint::new().arg("m", &FloatKeys(vec![(f32::NAN, 1.0)]))), "m");
        let unit_key = Fingerprint::new().arg("m", &BTreeMap::from([((), 1)]));
        assert!(matches!(unit_key.finish(), Err(Error::Serialize(_))));
    }

    /// A map whose `Serialize` gives a key and no value.
    struct Dangling;

    impl Serialize for Dangling {
        fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
            use serde::ser::SerializeMap;
            let mut map = serializer.serialize_map(None)?;
            map.serialize_entry("b", &1)?;
            map.serialize_key("lost")?;
            map.serialize_entry("a", &2)?;
            map.serialize_key("z")?;
            map.end()
        }
    }

    #[test]
    fn a_key_given_no_value_is_dropped_as_a_json_value_drops_it() {
        writes_as_walked(&Dangling);
        let written = Fingerprint::new().arg("v", &Dangling).document().unwrap();
        assert_eq!(written, br#"{"v":{"a":2,"b":1}}"#);
    }
}
