//! The `dedupvol` command-line tool (being written).
fn main() {}
