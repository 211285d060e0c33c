//! The `#[idempotent]` attribute. Use it through the `idem` crate, whose
//! documentation of [`idempotent`] is the reference.
//!
//! Pipeline: [`attr`] parses the arguments, [`key`] the key template, [`ttl`]
//! the durations, [`sig`] checks the fn against them, [`expand`] writes code.

use proc_macro::TokenStream;

mod attr;
mod expand;
mod key;
mod sig;
mod ttl;

/// Makes an `async fn` run once per business action. See `idem::idempotent`.
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}
