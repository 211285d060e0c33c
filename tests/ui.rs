// Guards what `#[idempotent]` accepts and how it rejects mistakes: every
// valid shape must compile, every invalid one must fail with the message
// (and span) recorded in the matching `.stderr`.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
