//! The fingerprint of a call's arguments: SHA-256 over a canonical JSON
//! document, so that "same key, other arguments" is detected.
//!
//! Canonical means object keys sorted at every depth, written by this module
//! rather than by `serde_json::to_string`: the order of a `HashMap`, and
//! whether some crate in the build enabled serde_json's `preserve_order`,
//! must not change the hash.
//!
//! `-0.0` is written `0.0`: the two are equal as values, and equal values
//! fingerprint alike.
//!
//! A float that is NaN or infinite is refused ([`Error::NonFiniteFloat`]):
//! serde_json writes all three as `null`, so `Some(f64::NAN)`,
//! `Some(f64::INFINITY)` and `None` would share a fingerprint and replay each
//! other's results. The check rides along the one serialization (a wrapper
//! around serde_json's own value serializer), at any depth.

use std::cell::Cell;

use serde::Serialize;
use serde::ser::{self, Serializer};
use serde_json::Value;
use sha2::{Digest, Sha256};

use crate::error::Error;

/// Collects the fingerprinted arguments of one call, by parameter name.
#[derive(Debug, Default)]
pub struct Fingerprint {
    args: Vec<(&'static str, Value)>,
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
        if let Some(v) = self.serialized(name, value) {
            self.args.push((name, v));
        }
        self
    }

    /// Adds one argument marked `#[idem(skip_if_default)]`: left out of the
    /// document when its JSON is the JSON of `T::default()` (`None`, `0`,
    /// `false`, `""`, empty), so an argument added to a fn keeps the
    /// fingerprints of the calls made before it existed. Compared as
    /// canonical bytes: what the fingerprint would hash.
    pub fn arg_unless_default<T: Fingerprinted + Default>(mut self, name: &'static str, value: &T) -> Self {
        let Some(v) = self.serialized(name, value) else { return self };
        let is_default = serde_json::to_value(T::default()).is_ok_and(|d| {
            let (mut given, mut default) = (Vec::new(), Vec::new());
            write_canonical(&v, &mut given);
            write_canonical(&d, &mut default);
            given == default
        });
        if !is_default {
            self.args.push((name, v));
        }
        self
    }

    /// `value` as a JSON value, or `None` with the first error noted.
    fn serialized<T: Serialize + ?Sized>(&mut self, name: &'static str, value: &T) -> Option<Value> {
        if self.error.is_some() {
            return None;
        }
        let non_finite = Cell::new(false);
        let serialized = Checked { value, non_finite: &non_finite }.serialize(serde_json::value::Serializer);
        // Checked even on `Ok`: a `Serialize` impl that swallowed our
        // refusal must not get the `null` through.
        match serialized {
            _ if non_finite.get() => self.error = Some(Error::NonFiniteFloat { arg: name }),
            Ok(v) => return Some(v),
            Err(e) => self.error = Some(Error::Serialize(e)),
        }
        None
    }

    /// The lowercase hex SHA-256 of the canonical JSON object `{name: value, ...}`.
    pub fn finish(self) -> Result<String, Error> {
        if let Some(e) = self.error {
            return Err(e);
        }
        // Written straight from the arguments: no object is built on every
        // call just to be walked once. Stable sort, then the last of equal
        // names, as an object built from them would keep.
        let mut args = self.args;
        args.sort_by(|a, b| a.0.cmp(b.0));
        let mut out = Vec::with_capacity(128);
        out.push(b'{');
        let mut first = true;
        for (i, (name, value)) in args.iter().enumerate() {
            if args.get(i + 1).is_some_and(|next| next.0 == *name) {
                continue;
            }
            if !first {
                out.push(b',');
            }
            first = false;
            write_json(&mut out, name);
            out.push(b':');
            write_canonical(value, &mut out);
        }
        out.push(b'}');
        Ok(sha256_hex(&out))
    }
}

/// JSON with object keys sorted (by bytes) at every depth and no whitespace.
#[cfg(any(test, fuzzing))]
pub(crate) fn canonical_json(value: &Value) -> String {
    let mut out = Vec::new();
    write_canonical(value, &mut out);
    String::from_utf8(out).expect("serde_json writes UTF-8")
}

fn write_canonical(value: &Value, out: &mut Vec<u8>) {
    match value {
        Value::Object(map) => {
            let mut entries: Vec<_> = map.iter().collect();
            entries.sort_unstable_by(|a, b| a.0.cmp(b.0));
            out.push(b'{');
            for (i, (k, v)) in entries.into_iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_json(out, k);
                out.push(b':');
                write_canonical(v, out);
            }
            out.push(b'}');
        }
        Value::Array(items) => {
            out.push(b'[');
            for (i, v) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_canonical(v, out);
            }
            out.push(b']');
        }
        // Equal as values, so one spelling: written as they come, equal
        // arguments would fingerprint apart.
        Value::Number(n) if n.as_f64().is_some_and(|x| x == 0.0 && x.is_sign_negative()) => {
            out.extend_from_slice(b"0.0")
        }
        scalar => write_json(out, scalar),
    }
}

/// A string or scalar as serde_json writes it (what `Value`'s `Display`
/// writes too). Neither a `Vec` nor these values can fail to write.
fn write_json<T: Serialize + ?Sized>(out: &mut Vec<u8>, value: &T) {
    let _ = serde_json::to_writer(out, value);
}

pub(crate) fn sha256_hex(bytes: &[u8]) -> String {
    let mut hex = String::with_capacity(64);
    push_lower_hex(&mut hex, &Sha256::digest(bytes));
    hex
}

/// Appends `bytes` as lowercase hex, two digits each: written into a
/// stack buffer, not a `char` at a time (this runs on every call, twice).
pub(crate) fn push_lower_hex(out: &mut String, bytes: &[u8]) {
    const DIGITS: &[u8; 16] = b"0123456789abcdef";
    out.reserve(bytes.len() * 2);
    for chunk in bytes.chunks(32) {
        let mut buf = [0u8; 64];
        for (pair, b) in buf.chunks_exact_mut(2).zip(chunk) {
            pair[0] = DIGITS[usize::from(b >> 4)];
            pair[1] = DIGITS[usize::from(b & 0xf)];
        }
        out.push_str(std::str::from_utf8(&buf[..chunk.len() * 2]).expect("hex digits are ASCII"));
    }
}

/// A value serialized through [`Finite`].
struct Checked<'a, T: ?Sized> {
    value: &'a T,
    non_finite: &'a Cell<bool>,
}

impl<T: Serialize + ?Sized> Serialize for Checked<'_, T> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        self.value.serialize(Finite { inner: serializer, non_finite: self.non_finite })
    }
}

/// Passes everything to `inner` except a NaN or infinite float, which it
/// refuses and notes in `non_finite` (so the caller tells it apart from
/// serde_json's own errors without reading a message). Every nested value
/// goes through a [`Checked`] again.
struct Finite<'a, S> {
    inner: S,
    non_finite: &'a Cell<bool>,
}

impl<S> Finite<'_, S> {
    fn refuse<E: ser::Error>(&self) -> E {
        self.non_finite.set(true);
        E::custom("a float that is NaN or infinite has no JSON form")
    }
}

macro_rules! pass {
    ($($method:ident($ty:ty)),* $(,)?) => {
        $(fn $method(self, v: $ty) -> Result<S::Ok, S::Error> {
            self.inner.$method(v)
        })*
    };
}

impl<'a, S: Serializer> Serializer for Finite<'a, S> {
    type Ok = S::Ok;
    type Error = S::Error;
    type SerializeSeq = Finite<'a, S::SerializeSeq>;
    type SerializeTuple = Finite<'a, S::SerializeTuple>;
    type SerializeTupleStruct = Finite<'a, S::SerializeTupleStruct>;
    type SerializeTupleVariant = Finite<'a, S::SerializeTupleVariant>;
    type SerializeMap = Finite<'a, S::SerializeMap>;
    type SerializeStruct = Finite<'a, S::SerializeStruct>;
    type SerializeStructVariant = Finite<'a, S::SerializeStructVariant>;

    pass!(
        serialize_bool(bool),
        serialize_i8(i8),
        serialize_i16(i16),
        serialize_i32(i32),
        serialize_i64(i64),
        serialize_i128(i128),
        serialize_u8(u8),
        serialize_u16(u16),
        serialize_u32(u32),
        serialize_u64(u64),
        serialize_u128(u128),
        serialize_char(char),
        serialize_str(&str),
        serialize_bytes(&[u8]),
        serialize_unit_struct(&'static str),
    );

    fn serialize_f32(self, v: f32) -> Result<S::Ok, S::Error> {
        if v.is_finite() { self.inner.serialize_f32(v) } else { Err(self.refuse()) }
    }

    fn serialize_f64(self, v: f64) -> Result<S::Ok, S::Error> {
        if v.is_finite() { self.inner.serialize_f64(v) } else { Err(self.refuse()) }
    }

    fn serialize_none(self) -> Result<S::Ok, S::Error> {
        self.inner.serialize_none()
    }

    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<S::Ok, S::Error> {
        self.inner.serialize_some(&Checked { value, non_finite: self.non_finite })
    }

    fn serialize_unit(self) -> Result<S::Ok, S::Error> {
        self.inner.serialize_unit()
    }

    fn serialize_unit_variant(self, name: &'static str, index: u32, variant: &'static str) -> Result<S::Ok, S::Error> {
        self.inner.serialize_unit_variant(name, index, variant)
    }

    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, name: &'static str, value: &T) -> Result<S::Ok, S::Error> {
        self.inner.serialize_newtype_struct(name, &Checked { value, non_finite: self.non_finite })
    }

    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        name: &'static str,
        index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<S::Ok, S::Error> {
        self.inner.serialize_newtype_variant(name, index, variant, &Checked { value, non_finite: self.non_finite })
    }

    fn serialize_seq(self, len: Option<usize>) -> Result<Self::SerializeSeq, S::Error> {
        Ok(Finite { inner: self.inner.serialize_seq(len)?, non_finite: self.non_finite })
    }

    fn serialize_tuple(self, len: usize) -> Result<Self::SerializeTuple, S::Error> {
        Ok(Finite { inner: self.inner.serialize_tuple(len)?, non_finite: self.non_finite })
    }

    fn serialize_tuple_struct(self, name: &'static str, len: usize) -> Result<Self::SerializeTupleStruct, S::Error> {
        Ok(Finite { inner: self.inner.serialize_tuple_struct(name, len)?, non_finite: self.non_finite })
    }

    fn serialize_tuple_variant(
        self,
        name: &'static str,
        index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Self::SerializeTupleVariant, S::Error> {
        let inner = self.inner.serialize_tuple_variant(name, index, variant, len)?;
        Ok(Finite { inner, non_finite: self.non_finite })
    }

    fn serialize_map(self, len: Option<usize>) -> Result<Self::SerializeMap, S::Error> {
        Ok(Finite { inner: self.inner.serialize_map(len)?, non_finite: self.non_finite })
    }

    fn serialize_struct(self, name: &'static str, len: usize) -> Result<Self::SerializeStruct, S::Error> {
        Ok(Finite { inner: self.inner.serialize_struct(name, len)?, non_finite: self.non_finite })
    }

    fn serialize_struct_variant(
        self,
        name: &'static str,
        index: u32,
        variant: &'static str,
        len: usize,
    ) -> Result<Self::SerializeStructVariant, S::Error> {
        let inner = self.inner.serialize_struct_variant(name, index, variant, len)?;
        Ok(Finite { inner, non_finite: self.non_finite })
    }

    fn collect_str<T: std::fmt::Display + ?Sized>(self, value: &T) -> Result<S::Ok, S::Error> {
        self.inner.collect_str(value)
    }

    fn is_human_readable(&self) -> bool {
        self.inner.is_human_readable()
    }
}

/// The compound serializers: each element, key and field goes through a
/// [`Checked`].
macro_rules! compound {
    ($($trait:ident::$method:ident),* $(,)?) => {
        $(impl<S: ser::$trait> ser::$trait for Finite<'_, S> {
            type Ok = S::Ok;
            type Error = S::Error;

            fn $method<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), S::Error> {
                let checked = Checked { value, non_finite: self.non_finite };
                self.inner.$method(&checked)
            }

            fn end(self) -> Result<S::Ok, S::Error> {
                self.inner.end()
            }
        })*
    };
}

compound!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field,
);

impl<S: ser::SerializeMap> ser::SerializeMap for Finite<'_, S> {
    type Ok = S::Ok;
    type Error = S::Error;

    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), S::Error> {
        self.inner.serialize_key(&Checked { value: key, non_finite: self.non_finite })
    }

    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), S::Error> {
        self.inner.serialize_value(&Checked { value, non_finite: self.non_finite })
    }

    fn serialize_entry<K: Serialize + ?Sized, V: Serialize + ?Sized>(
        &mut self,
        key: &K,
        value: &V,
    ) -> Result<(), S::Error> {
        let non_finite = self.non_finite;
        self.inner.serialize_entry(&Checked { value: key, non_finite }, &Checked { value, non_finite })
    }

    fn end(self) -> Result<S::Ok, S::Error> {
        self.inner.end()
    }
}

/// Structs and struct variants: named fields.
macro_rules! fields {
    ($($trait:ident),* $(,)?) => {
        $(impl<S: ser::$trait> ser::$trait for Finite<'_, S> {
            type Ok = S::Ok;
            type Error = S::Error;

            fn serialize_field<T: Serialize + ?Sized>(&mut self, key: &'static str, value: &T) -> Result<(), S::Error> {
                self.inner.serialize_field(key, &Checked { value, non_finite: self.non_finite })
            }

            fn skip_field(&mut self, key: &'static str) -> Result<(), S::Error> {
                self.inner.skip_field(key)
            }

            fn end(self) -> Result<S::Ok, S::Error> {
                self.inner.end()
            }
        })*
    };
}

fields!(SerializeStruct, SerializeStructVariant);

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
        assert_eq!(got.args, vec![("all", expected.clone())]);
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
}
