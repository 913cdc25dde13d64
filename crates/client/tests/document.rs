//! The client agrees with docs/openapi.json: every operation it calls is
//! documented with the same method, path and operation id, and every type's fields
//! are the documented schema's (a response type knows every required field).

use serde_json::Value;
use tally_client::{documented, OPERATIONS};

fn document() -> Value {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/openapi.json");
    let text = std::fs::read_to_string(path).expect("docs/openapi.json");
    serde_json::from_str(&text).expect("the document is JSON")
}

#[test]
fn every_operation_is_documented() {
    let doc = document();
    for (method, path, operation_id) in OPERATIONS {
        let operation = &doc["paths"][path][method];
        assert!(operation.is_object(), "{method} {path} is not documented");
        assert_eq!(operation["operationId"], operation_id, "{method} {path}");
    }
}

#[test]
fn every_type_matches_its_schema() {
    let doc = document();
    let schemas = &doc["components"]["schemas"];
    for (name, fields, request) in documented() {
        let schema = &schemas[name];
        let properties = schema["properties"]
            .as_object()
            .unwrap_or_else(|| panic!("no schema {name} in the document"));
        for field in fields {
            let wire = field.trim_start_matches("r#");
            assert!(
                properties.contains_key(wire),
                "{name}.{wire} is not in the documented schema"
            );
        }
        if !request {
            for required in schema["required"].as_array().into_iter().flatten() {
                let required = required.as_str().unwrap();
                assert!(
                    fields
                        .iter()
                        .any(|f| f.trim_start_matches("r#") == required),
                    "{name} lacks the required field {required}"
                );
            }
        }
    }
}
