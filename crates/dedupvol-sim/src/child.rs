//! Child mode of the real-process crash test (`tests/kill9.rs`).
pub fn child_writer(_path: &std::path::Path) {
    unimplemented!()
}
