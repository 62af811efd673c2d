//! JSON ↔ CEL conversion: how the variables enter an expression and how its result leaves.
//!
//! Guarantee: numbers keep their kind both ways. A JSON number that fits an `i64` becomes a
//! CEL `int`, a larger unsigned one a `uint`, anything else a `double`; on the way back a
//! non-finite double is an error ([`ExprError::NotJson`]), never a silent `null`. Objects come
//! back with sorted keys, so a result never depends on CEL's map order.

use std::collections::HashMap;

use cel::Value;
use cel::common::types::{
    CelBool, CelDouble, CelInt, CelList, CelMap, CelMapKey, CelNull, CelString, CelUInt,
};
use cel::common::value::Val;
use serde_json::Value as Json;

use super::error::ExprError;

/// The name of a JSON value's type, for messages.
pub fn type_name(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "bool",
        Json::Number(n) if n.is_f64() => "double",
        Json::Number(_) => "int",
        Json::String(_) => "string",
        Json::Array(_) => "list",
        Json::Object(_) => "map",
    }
}

/// Converts JSON into a CEL value without copying strings (see the module docs for numbers).
pub fn json_to_val(j: &Json) -> Box<dyn Val + '_> {
    match j {
        Json::Null => Box::new(CelNull),
        Json::Bool(b) => Box::new(CelBool::from(*b)),
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                Box::new(CelInt::from(i))
            } else if let Some(u) = n.as_u64() {
                Box::new(CelUInt::from(u))
            } else {
                Box::new(CelDouble::from(n.as_f64().unwrap_or(f64::NAN)))
            }
        }
        Json::String(s) => Box::new(CelString::from(s.as_str())),
        Json::Array(items) => Box::new(CelList::from(
            items.iter().map(json_to_val).collect::<Vec<_>>(),
        )),
        Json::Object(map) => {
            let m: HashMap<CelMapKey<'_>, Box<dyn Val + '_>> = map
                .iter()
                .map(|(k, v)| (CelMapKey::from(k.as_str()), json_to_val(v)))
                .collect();
            Box::new(CelMap::from(m))
        }
    }
}

/// Converts a CEL result into JSON. Map keys become strings; objects come out with sorted
/// keys (serde_json's map), so the output does not depend on CEL's map order.
pub fn cel_to_json(v: &Value) -> Result<Json, ExprError> {
    Ok(match v {
        Value::Null => Json::Null,
        Value::Bool(b) => Json::Bool(*b),
        Value::Int(i) => Json::from(*i),
        Value::UInt(u) => Json::from(*u),
        Value::Float(f) => serde_json::Number::from_f64(*f)
            .map(Json::Number)
            .ok_or_else(|| ExprError::NotJson(format!("non-finite number {f}")))?,
        Value::String(s) => Json::String(s.as_str().to_owned()),
        Value::List(items) => Json::Array(items.iter().map(cel_to_json).collect::<Result<_, _>>()?),
        Value::Map(m) => {
            let mut out = serde_json::Map::new();
            for (k, v) in m.map.iter() {
                let key = match k {
                    cel::objects::Key::String(s) => s.as_str().to_owned(),
                    cel::objects::Key::Int(i) => i.to_string(),
                    cel::objects::Key::Uint(u) => u.to_string(),
                    cel::objects::Key::Bool(b) => b.to_string(),
                };
                out.insert(key, cel_to_json(v)?);
            }
            Json::Object(out)
        }
        other => return Err(ExprError::NotJson(format!("{other:?}"))),
    })
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use serde_json::json;

    use super::*;
    use crate::expr::{Expr, Vars};

    fn eval(src: &str, event: Json, state: Json) -> Result<Json, ExprError> {
        let saga = json!({"name": "s"});
        let vars = Vars::new(&event, &state, &saga);
        Expr::compile(src)?.eval(&vars)
    }

    #[test]
    fn integers_are_signed_and_arithmetic_works() {
        assert_eq!(
            eval("state.n + 1", json!({}), json!({"n": 41})).unwrap(),
            json!(42)
        );
        assert_eq!(
            eval("state.x * 2.0", json!({}), json!({"x": 1.5})).unwrap(),
            json!(3.0)
        );
        assert_eq!(
            eval(
                "event.payload.amount > 10",
                json!({"payload": {"amount": 12}}),
                json!({})
            )
            .unwrap(),
            json!(true)
        );
    }

    #[test]
    fn objects_round_trip_with_sorted_keys() {
        let out = eval(
            "{'b': state.b, 'a': [1, 'x', null]}",
            json!({}),
            json!({"b": true}),
        )
        .unwrap();
        assert_eq!(
            serde_json::to_string(&out).unwrap(),
            r#"{"a":[1,"x",null],"b":true}"#
        );
    }
}
