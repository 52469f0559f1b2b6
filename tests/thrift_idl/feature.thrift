// Test IDL for dataset.thrift's fast path: feature records shaped like Twitter's
// DataRecord (twml's data_record.thrift): a struct of a few large containers of numbers.
// FeatureRecordV2 adds fields an older reader does not know; Example nests records.
namespace py feature

struct FeatureRecord {
  1: optional set<i64> binaryFeatures,
  2: optional map<i64, double> continuousFeatures,
  3: optional map<i64, i64> discreteFeatures,
  4: optional map<i64, string> stringFeatures,
  5: optional map<i64, set<string>> sparseBinaryFeatures,
  6: optional map<i64, map<string, double>> sparseContinuousFeatures,
  7: optional map<i64, binary> blobFeatures,
}

struct FeatureRecordV2 {
  1: optional set<i64> binaryFeatures,
  2: optional map<i64, double> continuousFeatures,
  3: optional map<i64, i64> discreteFeatures,
  4: optional map<i64, string> stringFeatures,
  5: optional map<i64, set<string>> sparseBinaryFeatures,
  6: optional map<i64, map<string, double>> sparseContinuousFeatures,
  7: optional map<i64, binary> blobFeatures,
  8: optional list<i32> shape,
  9: optional list<double> dense,
  10: optional list<i16> small,
  11: optional list<i8> tiny,
  12: optional list<bool> flags,
  13: optional map<i32, i16> counts,
}

struct Example {
  1: optional FeatureRecord features,
  2: optional list<FeatureRecord> context,
  3: optional i32 label,
  4: optional double weight,
  5: optional bool keep,
  6: optional i8 source,
  7: optional i16 version,
  8: optional string id,
  9: optional map<string, list<map<i64, double>>> deep,
}
