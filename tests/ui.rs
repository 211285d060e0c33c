// Guards what `#[idempotent]` accepts and how it rejects mistakes: every
// valid shape must compile, every invalid one must fail with the message
// (and span) recorded in the matching `.stderr`.
//
// The `.stderr` files are generated under the README's test command
// (`TRYBUILD=overwrite cargo test --workspace --all-features --test ui`): rustc
// lists "other types that implement Serialize", and that list depends on the
// features compiled in.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
