//! The fn called from the test: its `Result`, and the outcome `observe` saw.

use std::sync::Arc;

use super::{Answer, EntryPoint, Shape, from_result};
use crate::backends::Store;
use crate::fns::BoxFuture;
use crate::script::Script;

pub struct Direct<F: Store>(pub Shape<F>);

impl<F: Store> EntryPoint for Direct<F> {
    fn call(&self, key: &str, amount: i64, script: Arc<Script>) -> BoxFuture<'static, Answer> {
        let (shape, key) = (self.0.clone(), key.to_owned());
        Box::pin(async move {
            let (result, outcome) = idempotency::observe(shape.call(key, amount, &script)).await;
            from_result(&result, outcome)
        })
    }
}
