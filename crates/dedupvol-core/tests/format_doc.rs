//! docs/format.md's constants table must match the code (so the two cannot drift).
use dedupvol_core::format;

#[test]
fn format_doc_constants_match_code() {
    let doc =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/format.md")).expect("docs/format.md");
    let code: &[(&str, u64)] = &[
        ("BLOCK_SIZE", dedupvol_core::BLOCK_SIZE as u64),
        ("SUPERBLOCK_RAW_BYTES", std::mem::size_of::<format::SuperblockRaw>() as u64),
        ("LIFETIME_RECORD_OFFSET", format::LIFETIME_RECORD_OFFSET as u64),
        ("LIFETIME_RECORD_BYTES", std::mem::size_of::<format::LifetimeRaw>() as u64),
        ("LIFETIME_COUNTERS", dedupvol_core::LifetimeCounters::WORDS as u64),
        ("PAGE_HEADER_BYTES", format::PAGE_HEADER_BYTES as u64),
        ("MAP_ENTRY_BYTES", format::MAP_ENTRY_BYTES as u64),
        ("BM_ENTRIES_PER_PAGE", format::BM_ENTRIES_PER_PAGE),
        ("RC_ENTRIES_PER_PAGE", format::RC_ENTRIES_PER_PAGE),
        ("JOURNAL_HEADER_BYTES", format::JOURNAL_HEADER_BYTES as u64),
        ("JOURNAL_ENTRY_BYTES", format::JOURNAL_ENTRY_BYTES as u64),
        ("JOURNAL_ENTRIES_PER_BLOCK", format::JOURNAL_ENTRIES_PER_BLOCK as u64),
        ("UNIT_BLOCKS_MAX", u64::from(format::UNIT_BLOCKS_MAX)),
        ("RUN_BLOCKS_MAX", format::RUN_BLOCKS_MAX),
        ("REFCOUNT_MAX", u64::from(format::REFCOUNT_MAX)),
        ("CHAPTER_PAGE_HEADER_BYTES", format::CHAPTER_PAGE_HEADER_BYTES as u64),
        ("RECORD_BYTES", format::RECORD_BYTES as u64),
        ("RECORDS_PER_PAGE", format::RECORDS_PER_PAGE as u64),
        ("CHAPTER_PAGES_MAX", format::CHAPTER_PAGES_MAX),
        ("RING_CHAPTERS_MAX", format::RING_CHAPTERS_MAX),
        ("INDEX_SLOT_BYTES", format::INDEX_SLOT_BYTES),
        ("SPARSE_SAMPLE", format::SPARSE_SAMPLE),
        ("TIER_HEADER_BYTES", std::mem::size_of::<format::TierHeaderRaw>() as u64),
        ("TIER_RECORD_BYTES", std::mem::size_of::<format::TierSlotRecordRaw>() as u64),
        ("TIER_RECORDS_PER_PAGE", format::TIER_RECORDS_PER_PAGE as u64),
        ("TIER_SLOT_BYTES", format::TIER_SLOT_BYTES as u64),
        ("TIER_SLOTS_MAX", format::TIER_SLOTS_MAX),
        ("TIER_FORMAT_VERSION", u64::from(format::TIER_FORMAT_VERSION)),
        ("RADOS_OBJECT_BYTES", format::RADOS_OBJECT_BYTES),
        ("FORMAT_VERSION", u64::from(format::FORMAT_VERSION)),
        ("FORMAT_VERSION_STRIPED", u64::from(format::FORMAT_VERSION_STRIPED)),
        ("FORMAT_VERSION_REST", u64::from(format::FORMAT_VERSION_REST)),
        ("FORMAT_VERSION_REST_STRIPED", u64::from(format::FORMAT_VERSION_REST_STRIPED)),
        ("FORMAT_VERSION_DICT", u64::from(format::FORMAT_VERSION_DICT)),
        ("FORMAT_VERSION_DICT_STRIPED", u64::from(format::FORMAT_VERSION_DICT_STRIPED)),
        ("DICT_RECORD_OFFSET", format::DICT_RECORD_OFFSET as u64),
        ("DICT_RECORD_BYTES", std::mem::size_of::<format::DictRaw>() as u64),
        ("DICT_AREA_BLOCKS", format::DICT_AREA_BLOCKS),
        ("DICT_BYTES_MAX", format::DICT_BYTES_MAX as u64),
        ("DICT_UNIT_BYTES_MAX", format::DICT_UNIT_BYTES_MAX as u64),
        ("FRAG_SETTLED", u64::from(format::FRAG_SETTLED)),
        ("DATA_DEVICES_MAX", format::DATA_DEVICES_MAX as u64),
        ("STRIPE_UNIT_BLOCKS", format::STRIPE_UNIT_BLOCKS),
        ("STRIPE_RECORD_OFFSET", format::STRIPE_RECORD_OFFSET as u64),
        ("STRIPE_RECORD_BYTES", std::mem::size_of::<format::StripeRaw>() as u64),
        ("STRIPE_PATH_BYTES_MAX", format::STRIPE_PATH_BYTES_MAX as u64),
        ("MEMBER_HEADER_BYTES", std::mem::size_of::<format::MemberHeaderRaw>() as u64),
        ("MEMBER_DATA_START_BLOCKS", format::MEMBER_DATA_START_BLOCKS),
    ];
    for (name, value) in code {
        let row = doc
            .lines()
            .find(|l| l.starts_with(&format!("| `{name}` |")))
            .unwrap_or_else(|| panic!("docs/format.md has no row for {name}"));
        let documented: u64 =
            row.split('|').nth(2).and_then(|v| v.trim().parse().ok()).unwrap_or_else(|| panic!("bad row {row}"));
        assert_eq!(documented, *value, "docs/format.md says {name} = {documented}, the code has {value}");
    }
    // Superblock field offsets quoted in the doc.
    for (off, field) in [(48usize, "logical_blocks"), (160, "index_memory_bytes"), (216, "metadata device path")] {
        assert!(doc.contains(&format!("| {off} |")), "offset {off} ({field}) missing from the doc");
    }
    // The chapter record page's header fields, at the offsets the code writes them.
    assert_eq!(format::CHAPTER_MAGIC, u32::from_le_bytes(*b"DVCP"));
    assert!(doc.contains("| 0 | 4 | magic `DVCP` |"), "the record page's magic row is missing");
    for (off, field) in
        [(16usize, "virtual chapter number"), (24, "epoch"), (28, "page number"), (30, "records in this page")]
    {
        assert!(
            doc.lines().any(|l| l.starts_with(&format!("| {off} |")) && l.contains(field)),
            "record page field {field} at {off} missing from the doc"
        );
    }
    let tail = format::CHAPTER_PAGE_HEADER_BYTES + format::RECORDS_PER_PAGE * format::RECORD_BYTES;
    assert!(doc.contains(&format!("| {tail} | {} | zero |", dedupvol_core::BLOCK_SIZE - tail)));
    // The stripe record's and the extra device header's fields.
    for row in ["| 1024 | 4 | magic `DVST` |", "| 1040 | 8 | rows:", "| 44 | 4 | device index d", "| 64 | 8 | rows |"] {
        assert!(doc.contains(row), "docs/format.md lacks the row {row}");
    }
    let (off, field) = (47usize, "index mode");
    assert!(doc.contains(&format!("| {off} |")), "offset {off} ({field}) missing from the doc");
    // The lifetime counters, in on-disk order: the doc's rows `| 520 + 8i | 8 | name |`
    // must name the code's fields in the code's order (the JSON keys are the field names).
    let json = serde_json::to_value(dedupvol_core::LifetimeCounters::default()).expect("json");
    let names: Vec<&String> = json.as_object().expect("object").keys().collect();
    assert_eq!(names.len(), dedupvol_core::LifetimeCounters::WORDS);
    let from_words = dedupvol_core::LifetimeCounters::from_words(std::array::from_fn(|i| i as u64));
    let order = serde_json::to_value(from_words).expect("json");
    for name in names {
        let i = order[name.as_str()].as_u64().expect("u64");
        let off = format::LIFETIME_RECORD_OFFSET as u64 + 8 + 8 * i;
        let row = format!("| {off} | 8 | `{name}` |");
        assert!(doc.contains(&row), "docs/format.md lacks the lifetime counter row {row}");
    }
}
