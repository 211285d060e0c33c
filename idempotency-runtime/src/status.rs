//! Where a call stands, for callers told "in progress, ask again later".

/// The answer of [`Idem::status`](crate::Idem::status).
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Status {
    /// No call with this key is recorded or running.
    Absent,
    /// A call holds the key right now (seen through its Redis claim; without
    /// Redis a running call is invisible until it commits).
    InProgress,
    /// A call finished; `response` is its result as stored (JSON).
    Completed {
        /// The stored result, byte for byte.
        response: String,
    },
    /// A call finished but its record outlived the ttl: the next call executes.
    Expired,
    /// A call finished with a business error its fn declares final
    /// (`record_errors`): every duplicate gets it; `error` is its record
    /// as stored (JSON).
    Failed {
        /// The recorded error, byte for byte.
        error: String,
    },
}

impl Status {
    /// Deserializes the stored response of a `Completed` status.
    pub fn response<T: serde::de::DeserializeOwned>(&self) -> Option<Result<T, serde_json::Error>> {
        match self {
            Status::Completed { response } => Some(serde_json::from_str(response)),
            _ => None,
        }
    }
}
