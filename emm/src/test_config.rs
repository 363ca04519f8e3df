//! Settings shared by the crate's own property tests (layer 0; compiled for tests only).

/// A property test's configuration: `PROPTEST_CASES` cases, else 256 (4 under Miri, which is
/// a hundred times slower), and no failure files written into the source tree.
pub(crate) fn proptest_config() -> proptest::test_runner::Config {
    let cases = std::env::var("PROPTEST_CASES")
        .ok()
        .and_then(|c| c.parse().ok())
        .unwrap_or(if cfg!(miri) { 4 } else { 256 });
    proptest::test_runner::Config {
        cases,
        failure_persistence: None,
        ..Default::default()
    }
}
