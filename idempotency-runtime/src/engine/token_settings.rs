//! The engine's settings for issued tokens, set on its builder
//! ([`Builder::token_used_for`](crate::Builder::token_used_for),
//! [`Builder::token_consume_with_lua`](crate::Builder::token_consume_with_lua)).

use std::time::Duration;

/// Default of [`Builder::token_used_for`](crate::Builder::token_used_for).
pub const DEFAULT_USED_FOR: Duration = Duration::from_secs(24 * 3600);

/// The engine's settings for tokens, set on its builder.
#[derive(Debug)]
pub(crate) struct Settings {
    pub(crate) used_for: Duration,
    /// Consume with the Lua script: set on the builder, or learnt from a
    /// server that does not know `GETDEL`.
    #[cfg(feature = "redis")]
    lua: std::sync::atomic::AtomicBool,
}

impl Default for Settings {
    fn default() -> Self {
        Self {
            used_for: DEFAULT_USED_FOR,
            #[cfg(feature = "redis")]
            lua: std::sync::atomic::AtomicBool::new(false),
        }
    }
}

#[cfg(feature = "redis")]
impl Settings {
    pub(crate) fn set_lua(&self, lua: bool) {
        self.lua.store(lua, std::sync::atomic::Ordering::Relaxed);
    }

    pub(crate) fn lua(&self) -> bool {
        self.lua.load(std::sync::atomic::Ordering::Relaxed)
    }
}
