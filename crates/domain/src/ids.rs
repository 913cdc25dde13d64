//! Newtype ids, so that one kind of id cannot be passed where another is expected
//! (a customer id where a meter id belongs, a store id where an account id does):
//! the compiler refuses what a `&str` parameter would have taken silently.
//!
//! Each wraps the id's text in an `Arc<str>`, so the many copies an id makes (cache
//! keys, records, projection keys) share one allocation. Ids read as `&str` through
//! `Deref` and `as_str`, for keys, wire types and messages; an id is made from text
//! only at the edges (a path parameter, a decoded record, a freshly generated id).

use std::borrow::Borrow;
use std::fmt;
use std::ops::Deref;
use std::sync::Arc;

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident) => {
        $(#[$doc])*
        #[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
        pub struct $name(Arc<str>);

        impl $name {
            pub fn new(text: impl Into<Arc<str>>) -> Self {
                $name(text.into())
            }

            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl Deref for $name {
            type Target = str;
            fn deref(&self) -> &str {
                &self.0
            }
        }

        impl AsRef<str> for $name {
            fn as_ref(&self) -> &str {
                &self.0
            }
        }

        /// Maps keyed by the id can be searched with a plain `&str` (the hash and
        /// order are the text's).
        impl Borrow<str> for $name {
            fn borrow(&self) -> &str {
                &self.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{:?}", &*self.0)
            }
        }

        impl From<String> for $name {
            fn from(text: String) -> Self {
                $name(text.into())
            }
        }

        impl From<&str> for $name {
            fn from(text: &str) -> Self {
                $name(text.into())
            }
        }

        impl From<&String> for $name {
            fn from(text: &String) -> Self {
                $name(text.as_str().into())
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0.to_string()
            }
        }

        /// On the wire an id is its text.
        impl serde::Serialize for $name {
            fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
                serializer.serialize_str(&self.0)
            }
        }

        impl PartialEq<str> for $name {
            fn eq(&self, other: &str) -> bool {
                &*self.0 == other
            }
        }

        impl PartialEq<&str> for $name {
            fn eq(&self, other: &&str) -> bool {
                &*self.0 == *other
            }
        }

        impl PartialEq<String> for $name {
            fn eq(&self, other: &String) -> bool {
                &*self.0 == other.as_str()
            }
        }
    };
}

id_type!(
    /// A store (the tenant): `st_...`.
    StoreId
);
id_type!(
    /// A customer of a store: `cus_...`.
    CustomerId
);
id_type!(
    /// A meter: `mtr_...`.
    MeterId
);
id_type!(
    /// A customer credits account: `ca_...`.
    AccountId
);
id_type!(
    /// A credits transaction: `ctx_...`.
    TransactionId
);
id_type!(
    /// A webhook endpoint: `wh_...`.
    EndpointId
);
id_type!(
    /// A product: `prod_...`.
    ProductId
);

id_type!(
    /// A discount: `dis_...`.
    DiscountId
);
id_type!(
    /// A checkout session: `chk_...`.
    CheckoutId
);
id_type!(
    /// A subscription: `sub_...`.
    SubscriptionId
);
id_type!(
    /// A payment or refund transaction of the billing context: `txn_...`.
    PaymentId
);
id_type!(
    /// A dispute: `dp_...`.
    DisputeId
);

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn ids_read_as_their_text_and_compare_with_it() {
        let id = CustomerId::from("cus_1");
        assert_eq!(id.as_str(), "cus_1");
        assert_eq!(id.to_string(), "cus_1");
        assert_eq!(format!("{id:?}"), "\"cus_1\"");
        assert!(id == "cus_1");
        assert!(id != "cus_2");
        let mut by_id = HashMap::new();
        by_id.insert(id.clone(), 1);
        assert_eq!(by_id.get("cus_1"), Some(&1));
        assert_eq!(String::from(id), "cus_1");
    }
}
id_type!(
    /// An affiliate: `aff_...`.
    AffiliateId
);
id_type!(
    /// An invitation to become an affiliate: `inv_...`.
    InviteId
);
id_type!(
    /// A hold on an account's credits: `rsv_...`.
    ReservationId
);
id_type!(
    /// A credit grant: `grt_...`.
    GrantId
);
