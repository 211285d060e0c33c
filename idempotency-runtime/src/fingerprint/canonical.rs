//! The canonical JSON writer: a serde `Serializer` that writes a value's
//! canonical bytes straight into one buffer, with no `serde_json::Value`
//! built on the way (that cost an allocation per string, key and object,
//! on every call).
//!
//! It writes what `serde_json::to_value` followed by the canonical walk
//! wrote, byte for byte (stored records carry those fingerprints):
//! scalars as serde_json writes them (it writes them here), `-0.0` as
//! `0.0`, 128-bit integers only within 64 bits, bytes as an array of
//! numbers, map keys as serde_json's value serializer turns them into
//! strings, and every object's entries in the byte order of their
//! (unescaped) keys, the last of a repeated key kept. Entries are written
//! as they come and moved only when they came out of order.
//!
//! A NaN or infinite float anywhere is refused and noted in `non_finite`,
//! which the caller checks even when serialization succeeded (a
//! `Serialize` impl may swallow the refusal).

use std::borrow::Cow;
use std::cell::Cell;
use std::fmt::Display;

use serde::Serialize;
use serde::ser::{self, Error as _, Serializer};

pub(super) type Error = serde_json::Error;

mod map_key;

use map_key::KeyWriter;

/// A document being written, and the object entries still open in it.
#[derive(Debug, Default)]
pub(super) struct Writer {
    pub out: Vec<u8>,
    /// The entries of every object being written, innermost last.
    entries: Vec<Entry>,
    pub non_finite: bool,
}

/// The largest document buffer a thread keeps for its next document.
const SPARE_MAX: usize = 16 * 1024;

thread_local! {
    /// This thread's spare buffers ([`Writer::recycle`]).
    static SPARE: Cell<(Vec<u8>, Vec<Entry>)> = const { Cell::new((Vec::new(), Vec::new())) };
}

/// One entry of an open object: its key's JSON at `key_start..key_end`
/// (`escaped` if it holds an escape), then `:` and its value up to
/// `value_end`.
#[derive(Debug, Clone, Copy)]
struct Entry {
    key_start: usize,
    key_end: usize,
    value_end: usize,
    escaped: bool,
}

/// An object being written: its `{` at `start`, its entries from `base`.
#[derive(Debug, Clone, Copy)]
pub(super) struct Object {
    start: usize,
    base: usize,
}

impl Object {
    /// A document's outermost object, begun first in an empty writer.
    pub const ROOT: Object = Object { start: 0, base: 0 };
}

impl Writer {
    /// serde_json's own compact writer, for scalars.
    fn json(&mut self) -> serde_json::Serializer<&mut Vec<u8>> {
        serde_json::Serializer::new(&mut self.out)
    }

    fn refuse(&mut self) -> Error {
        self.non_finite = true;
        Error::custom("a float that is NaN or infinite has no JSON form")
    }

    /// Room for a typical call's arguments, and for the copy past the end
    /// that sorting an object which came out of order takes: the buffers
    /// this thread's last document gave back ([`Writer::recycle`]), if any.
    pub fn reserve(&mut self) {
        if self.out.capacity() == 0 {
            (self.out, self.entries) = SPARE.take();
        }
        self.out.reserve(512);
        self.entries.reserve(8);
    }

    /// Gives a finished document's buffers to this thread's next one: a
    /// call writes its fingerprint and hashes it before it awaits anything,
    /// so one pair per thread serves every call, and stays in the cache.
    /// Buffers a large argument grew are let go.
    pub fn recycle(mut self) {
        if self.out.capacity() <= SPARE_MAX && self.entries.capacity() <= SPARE_MAX / 16 {
            self.out.clear();
            self.entries.clear();
            SPARE.set((self.out, self.entries));
        }
    }

    pub fn begin_object(&mut self) -> Object {
        self.out.push(b'{');
        Object { start: self.out.len() - 1, base: self.entries.len() }
    }

    /// Opens the next entry of `object`, its key written by `key`.
    fn key(&mut self, object: Object, key: impl FnOnce(&mut Self) -> Result<(), Error>) -> Result<(), Error> {
        if self.entries.len() > object.base {
            self.out.push(b',');
        }
        let key_start = self.out.len();
        key(self)?;
        let key_end = self.out.len();
        // Looked at once here, not at every comparison of the sort.
        let escaped = self.out[key_start..key_end].contains(&b'\\');
        self.out.push(b':');
        self.entries.push(Entry { key_start, key_end, value_end: key_end + 1, escaped });
        Ok(())
    }

    /// Writes the value of the entry just opened.
    fn value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        let index = self.entries.len() - 1;
        value.serialize(&mut *self)?;
        // Inner objects closed their own entries: the last is this one.
        self.entries[index].value_end = self.out.len();
        Ok(())
    }

    /// An entry keyed by a name (a struct's field, an argument).
    pub fn field<T: Serialize + ?Sized>(&mut self, object: Object, name: &str, value: &T) -> Result<(), Error> {
        self.key(object, |w| w.json().serialize_str(name))?;
        self.value(value)
    }

    /// Drops the entry just written (its separator too).
    pub fn drop_last(&mut self, object: Object) {
        if let Some(entry) = self.entries.pop() {
            let separator = usize::from(self.entries.len() > object.base);
            self.out.truncate(entry.key_start - separator);
        }
    }

    /// The bytes of the last entry's value.
    pub fn last_value(&self) -> &[u8] {
        self.entries.last().map_or(&[], |e| &self.out[e.key_end + 1..e.value_end])
    }

    /// Closes `object`: its entries in key order, one per key.
    pub fn end_object(&mut self, object: Object) {
        let entries = &self.entries[object.base..];
        let in_order = entries.windows(2).all(|pair| raw_key(&self.out, &pair[0]) < raw_key(&self.out, &pair[1]));
        if !in_order {
            self.reorder(object);
        }
        self.entries.truncate(object.base);
        self.out.push(b'}');
    }

    /// Rewrites `object`'s entries sorted (stable) by key, the last of
    /// equal keys kept. In the buffer itself: the entries are copied past
    /// its end and moved back in order (the sorted ones are never longer,
    /// so a move never overtakes what it reads).
    fn reorder(&mut self, object: Object) {
        let Writer { out, entries, .. } = self;
        let entries = &mut entries[object.base..];
        entries.sort_by(|a, b| raw_key(out, a).cmp(&raw_key(out, b)));
        let body = object.start + 1;
        let copy = out.len();
        out.extend_from_within(body..);
        let mut to = body;
        for (i, entry) in entries.iter().enumerate() {
            // Keys are read in the copy: the moves overwrite the originals.
            let moved = &out[copy - body..];
            if entries.get(i + 1).is_some_and(|next| raw_key(moved, next) == raw_key(moved, entry)) {
                continue;
            }
            if to > body {
                out[to] = b',';
                to += 1;
            }
            let from = copy + entry.key_start - body..copy + entry.value_end - body;
            let len = from.len();
            out.copy_within(from, to);
            to += len;
        }
        out.truncate(to);
    }

    fn float(&mut self, v: f64) -> Result<(), Error> {
        if !v.is_finite() {
            return Err(self.refuse());
        }
        // Equal as values, so one spelling: written as they come, equal
        // arguments would fingerprint apart.
        if v == 0.0 && v.is_sign_negative() {
            self.out.extend_from_slice(b"0.0");
            return Ok(());
        }
        self.json().serialize_f64(v)
    }

    fn variant_open(&mut self, variant: &str) -> Result<(), Error> {
        self.out.push(b'{');
        self.json().serialize_str(variant)?;
        self.out.push(b':');
        Ok(())
    }
}

/// A key as the bytes it is compared by: unescaped.
fn raw_key<'a>(out: &'a [u8], entry: &Entry) -> Cow<'a, [u8]> {
    let json = &out[entry.key_start..entry.key_end];
    let inner = &json[1..json.len() - 1];
    if !entry.escaped {
        return Cow::Borrowed(inner);
    }
    match serde_json::from_slice::<String>(json) {
        Ok(key) => Cow::Owned(key.into_bytes()),
        Err(_) => Cow::Borrowed(inner), // never: the writer wrote it
    }
}

fn out_of_range() -> Error {
    Error::custom("number out of range")
}

/// Scalars serde_json writes as a JSON value holds them.
macro_rules! as_serde_json {
    ($($method:ident($ty:ty)),* $(,)?) => {
        $(fn $method(self, v: $ty) -> Result<(), Error> {
            self.json().$method(v)
        })*
    };
}

impl<'a> Serializer for &'a mut Writer {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Seq<'a>;
    type SerializeTuple = Seq<'a>;
    type SerializeTupleStruct = Seq<'a>;
    type SerializeTupleVariant = Seq<'a>;
    type SerializeMap = Map<'a>;
    type SerializeStruct = Map<'a>;
    type SerializeStructVariant = Map<'a>;

    as_serde_json!(
        serialize_bool(bool),
        serialize_i8(i8),
        serialize_i16(i16),
        serialize_i32(i32),
        serialize_i64(i64),
        serialize_u8(u8),
        serialize_u16(u16),
        serialize_u32(u32),
        serialize_u64(u64),
        serialize_char(char),
        serialize_str(&str),
    );

    fn serialize_i128(self, v: i128) -> Result<(), Error> {
        match (u64::try_from(v), i64::try_from(v)) {
            (Ok(u), _) => self.serialize_u64(u),
            (_, Ok(i)) => self.serialize_i64(i),
            _ => Err(out_of_range()),
        }
    }
    fn serialize_u128(self, v: u128) -> Result<(), Error> {
        u64::try_from(v).map_err(|_| out_of_range()).and_then(|u| self.serialize_u64(u))
    }
    /// As a JSON value holds it: widened to `f64`.
    fn serialize_f32(self, v: f32) -> Result<(), Error> {
        self.float(f64::from(v))
    }
    fn serialize_f64(self, v: f64) -> Result<(), Error> {
        self.float(v)
    }
    fn serialize_bytes(self, v: &[u8]) -> Result<(), Error> {
        v.serialize(self) // an array of numbers, as a JSON value holds them
    }
    fn serialize_none(self) -> Result<(), Error> {
        self.serialize_unit()
    }
    fn serialize_some<T: Serialize + ?Sized>(self, value: &T) -> Result<(), Error> {
        value.serialize(self)
    }
    fn serialize_unit(self) -> Result<(), Error> {
        self.out.extend_from_slice(b"null");
        Ok(())
    }
    fn serialize_unit_struct(self, _name: &'static str) -> Result<(), Error> {
        self.serialize_unit()
    }
    fn serialize_unit_variant(self, _name: &'static str, _index: u32, variant: &'static str) -> Result<(), Error> {
        self.serialize_str(variant)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _name: &'static str, value: &T) -> Result<(), Error> {
        value.serialize(self)
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        value: &T,
    ) -> Result<(), Error> {
        self.variant_open(variant)?;
        value.serialize(&mut *self)?;
        self.out.push(b'}');
        Ok(())
    }
    fn serialize_seq(self, _len: Option<usize>) -> Result<Seq<'a>, Error> {
        self.out.push(b'[');
        Ok(Seq { w: self, first: true, close: b"]" })
    }
    fn serialize_tuple(self, len: usize) -> Result<Seq<'a>, Error> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_struct(self, _name: &'static str, len: usize) -> Result<Seq<'a>, Error> {
        self.serialize_seq(Some(len))
    }
    fn serialize_tuple_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Seq<'a>, Error> {
        self.variant_open(variant)?;
        self.out.push(b'[');
        Ok(Seq { w: self, first: true, close: b"]}" })
    }
    fn serialize_map(self, _len: Option<usize>) -> Result<Map<'a>, Error> {
        let object = self.begin_object();
        Ok(Map { w: self, object, pending: false, in_variant: false })
    }
    fn serialize_struct(self, _name: &'static str, len: usize) -> Result<Map<'a>, Error> {
        self.serialize_map(Some(len))
    }
    fn serialize_struct_variant(
        self,
        _name: &'static str,
        _index: u32,
        variant: &'static str,
        _len: usize,
    ) -> Result<Map<'a>, Error> {
        self.variant_open(variant)?;
        let object = self.begin_object();
        Ok(Map { w: self, object, pending: false, in_variant: true })
    }
    fn collect_str<T: Display + ?Sized>(self, value: &T) -> Result<(), Error> {
        self.json().collect_str(value)
    }
}

/// An array (or a tuple variant's, closed by `]}`).
pub(super) struct Seq<'a> {
    w: &'a mut Writer,
    first: bool,
    close: &'static [u8],
}

impl Seq<'_> {
    fn element<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        if !self.first {
            self.w.out.push(b',');
        }
        self.first = false;
        value.serialize(&mut *self.w)
    }

    fn close(self) -> Result<(), Error> {
        self.w.out.extend_from_slice(self.close);
        Ok(())
    }
}

macro_rules! seq {
    ($($trait:ident::$method:ident),* $(,)?) => {
        $(impl ser::$trait for Seq<'_> {
            type Ok = ();
            type Error = Error;

            fn $method<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
                self.element(value)
            }

            fn end(self) -> Result<(), Error> {
                self.close()
            }
        })*
    };
}

seq!(
    SerializeSeq::serialize_element,
    SerializeTuple::serialize_element,
    SerializeTupleStruct::serialize_field,
    SerializeTupleVariant::serialize_field,
);

/// An object: a map, a struct (or a struct variant's, closed by `}}`).
pub(super) struct Map<'a> {
    w: &'a mut Writer,
    object: Object,
    /// A key was written and its value not yet.
    pending: bool,
    in_variant: bool,
}

impl Map<'_> {
    /// A key given no value is dropped, as a JSON value's map drops it.
    fn drop_pending(&mut self) {
        if self.pending {
            self.w.drop_last(self.object);
            self.pending = false;
        }
    }

    fn close(mut self) -> Result<(), Error> {
        self.drop_pending();
        self.w.end_object(self.object);
        if self.in_variant {
            self.w.out.push(b'}');
        }
        Ok(())
    }
}

impl ser::SerializeMap for Map<'_> {
    type Ok = ();
    type Error = Error;

    fn serialize_key<T: Serialize + ?Sized>(&mut self, key: &T) -> Result<(), Error> {
        self.drop_pending();
        self.w.key(self.object, |w| key.serialize(KeyWriter { w }))?;
        self.pending = true;
        Ok(())
    }

    fn serialize_value<T: Serialize + ?Sized>(&mut self, value: &T) -> Result<(), Error> {
        if !self.pending {
            return Err(Error::custom("a map's value was given before its key"));
        }
        self.pending = false;
        self.w.value(value)
    }

    fn end(self) -> Result<(), Error> {
        self.close()
    }
}

macro_rules! fields {
    ($($trait:ident),* $(,)?) => {
        $(impl ser::$trait for Map<'_> {
            type Ok = ();
            type Error = Error;

            fn serialize_field<T: Serialize + ?Sized>(&mut self, key: &'static str, value: &T) -> Result<(), Error> {
                self.w.field(self.object, key, value)
            }

            fn end(self) -> Result<(), Error> {
                self.close()
            }
        })*
    };
}

fields!(SerializeStruct, SerializeStructVariant);
