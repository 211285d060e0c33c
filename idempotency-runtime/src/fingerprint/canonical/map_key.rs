//! A map's key, written as the JSON string serde_json's value serializer
//! makes of it (a JSON object's keys are strings).

use std::fmt::Display;
use std::io::Write as _;

use serde::Serialize;
use serde::ser::{Error as _, Impossible, Serializer};

use super::{Error, Writer};

fn key_must_be_a_string() -> Error {
    Error::custom("key must be a string")
}

/// A map's key, written as the JSON string serde_json's value serializer
/// makes of it: strings and chars as they are, integers, bools and finite
/// floats in their text form, a unit variant by its name, a newtype by its
/// inner value; anything else is not a key.
pub(super) struct KeyWriter<'a> {
    pub w: &'a mut Writer,
}

impl KeyWriter<'_> {
    /// A float key, quoted; refused (and noted) unless `finite`.
    fn float(
        self,
        finite: bool,
        write: impl FnOnce(&mut serde_json::Serializer<&mut Vec<u8>>) -> Result<(), Error>,
    ) -> Result<(), Error> {
        if !finite {
            return Err(self.w.refuse());
        }
        self.w.out.push(b'"');
        write(&mut self.w.json())?;
        self.w.out.push(b'"');
        Ok(())
    }

    fn quoted(self, text: impl Display) -> Result<(), Error> {
        // Integers, bools and floats: nothing in their text needs escaping.
        write!(self.w.out, "\"{text}\"").map_err(|e| Error::custom(e.to_string()))
    }
}

macro_rules! keys_as_text {
    ($($method:ident($ty:ty)),* $(,)?) => {
        $(fn $method(self, v: $ty) -> Result<(), Error> {
            self.quoted(v)
        })*
    };
}

macro_rules! not_keys {
    ($($method:ident($($arg:ty),*) -> $ret:ty),* $(,)?) => {
        $(fn $method(self, $(_: $arg),*) -> Result<$ret, Error> {
            Err(key_must_be_a_string())
        })*
    };
}

impl Serializer for KeyWriter<'_> {
    type Ok = ();
    type Error = Error;
    type SerializeSeq = Impossible<(), Error>;
    type SerializeTuple = Impossible<(), Error>;
    type SerializeTupleStruct = Impossible<(), Error>;
    type SerializeTupleVariant = Impossible<(), Error>;
    type SerializeMap = Impossible<(), Error>;
    type SerializeStruct = Impossible<(), Error>;
    type SerializeStructVariant = Impossible<(), Error>;

    keys_as_text!(
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
    );

    /// In its own shortest form (not widened, unlike a value).
    fn serialize_f32(self, v: f32) -> Result<(), Error> {
        self.float(v.is_finite(), |json| json.serialize_f32(v))
    }
    fn serialize_f64(self, v: f64) -> Result<(), Error> {
        self.float(v.is_finite(), |json| json.serialize_f64(v))
    }
    fn serialize_char(self, v: char) -> Result<(), Error> {
        self.w.json().serialize_char(v)
    }
    fn serialize_str(self, v: &str) -> Result<(), Error> {
        self.w.json().serialize_str(v)
    }
    fn serialize_unit_variant(self, _name: &'static str, _index: u32, variant: &'static str) -> Result<(), Error> {
        self.serialize_str(variant)
    }
    fn serialize_newtype_struct<T: Serialize + ?Sized>(self, _name: &'static str, value: &T) -> Result<(), Error> {
        value.serialize(self)
    }
    fn collect_str<T: Display + ?Sized>(self, value: &T) -> Result<(), Error> {
        self.w.json().collect_str(value)
    }
    fn serialize_some<T: Serialize + ?Sized>(self, _value: &T) -> Result<(), Error> {
        Err(key_must_be_a_string())
    }
    fn serialize_newtype_variant<T: Serialize + ?Sized>(
        self,
        _name: &'static str,
        _index: u32,
        _variant: &'static str,
        _value: &T,
    ) -> Result<(), Error> {
        Err(key_must_be_a_string())
    }

    not_keys!(
        serialize_bytes(&[u8]) -> (),
        serialize_none() -> (),
        serialize_unit() -> (),
        serialize_unit_struct(&'static str) -> (),
        serialize_seq(Option<usize>) -> Impossible<(), Error>,
        serialize_tuple(usize) -> Impossible<(), Error>,
        serialize_tuple_struct(&'static str, usize) -> Impossible<(), Error>,
        serialize_tuple_variant(&'static str, u32, &'static str, usize) -> Impossible<(), Error>,
        serialize_map(Option<usize>) -> Impossible<(), Error>,
        serialize_struct(&'static str, usize) -> Impossible<(), Error>,
        serialize_struct_variant(&'static str, u32, &'static str, usize) -> Impossible<(), Error>,
    );
}
