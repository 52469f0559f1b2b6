// Test IDL for dataset.thrift: the media record and a newer version of it with
// more fields, so tests check records that carry fields an older reader does not know.
namespace py media

struct MediaRecord {
  1: required binary image,
  2: optional string caption,
  3: optional list<i32> resolution,
}

struct Tag {
  1: string name,
  2: double score,
}

struct MediaRecordV2 {
  1: required binary image,
  2: optional string caption,
  3: optional list<i32> resolution,
  4: optional map<string, double> scores,
  5: optional list<Tag> tags,
  6: optional bool nsfw,
  7: optional set<i64> ids,
  8: optional i16 rotation,
  9: optional i8 quality,
  10: optional Tag primary,
  11: optional map<i32, list<string>> nested,
}
