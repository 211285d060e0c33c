//! What an adapter tells the core about its framework: how it keeps a
//! request's headers and how it spells a status. Sealed: the adapters in
//! this crate are the only implementations (axum's http 1 types,
//! actix-web's http 0.2 ones, and plain `u16` for the core itself).

/// An HTTP status as a framework spells it (`u16` in the core,
/// `http::StatusCode` for axum, actix-web's own `StatusCode`). Sealed.
pub trait HttpStatus: Copy + std::fmt::Debug + sealed::Sealed {
    /// The status with this code; the core only ever passes codes it knows
    /// (400, 403, 409, 422, 500, 503).
    fn from_code(code: u16) -> Self;
    /// The numeric code.
    fn code(self) -> u16;
}

/// A request's headers as a framework keeps them, read as raw bytes so
/// that the key and token rules see exactly what the client sent. Sealed.
pub trait RequestHeaders: sealed::Sealed {
    /// How this framework spells a status, for the problems the rules answer.
    type Status: HttpStatus;
    /// Every value of the header `name` (lower case), in the order sent.
    fn header_values(&self, name: &'static str) -> impl Iterator<Item = &[u8]>;
}

pub(crate) mod sealed {
    /// Keeps [`HttpStatus`](super::HttpStatus) and
    /// [`RequestHeaders`](super::RequestHeaders) to this crate's adapters.
    pub trait Sealed {}
}

impl sealed::Sealed for u16 {}

impl HttpStatus for u16 {
    fn from_code(code: u16) -> Self {
        code
    }

    fn code(self) -> u16 {
        self
    }
}
