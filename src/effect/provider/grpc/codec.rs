//! The wire codec of the `grpc` provider: protobuf messages known only at run time.
//!
//! Owns [`DynamicCodec`], a tonic codec that encodes a [`DynamicMessage`] and decodes the
//! bytes of a reply into a [`DynamicMessage`] of the method's output type. tonic does the
//! gRPC framing (length prefix, compression flag); this file only turns a message into its
//! protobuf bytes and back, through prost-reflect — no protobuf encoding is written here.
//!
//! Guarantee: a reply that is not a valid encoding of the output type is a decode error
//! (status `INTERNAL` from tonic), never a partly filled message passed on as a success.

use prost::Message;
use prost_reflect::{DynamicMessage, MessageDescriptor};
use tonic::Status;
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};

/// Encodes outgoing messages as they are and decodes incoming ones as messages of one type
/// (for a client, the method's reply type; for a server, its request type).
#[derive(Debug, Clone)]
pub struct DynamicCodec {
    incoming: MessageDescriptor,
}

impl DynamicCodec {
    /// A codec whose incoming messages are of type `incoming`.
    pub fn new(incoming: MessageDescriptor) -> Self {
        Self { incoming }
    }
}

impl Codec for DynamicCodec {
    type Encode = DynamicMessage;
    type Decode = DynamicMessage;
    type Encoder = DynamicEncoder;
    type Decoder = DynamicDecoder;

    fn encoder(&mut self) -> Self::Encoder {
        DynamicEncoder
    }

    fn decoder(&mut self) -> Self::Decoder {
        DynamicDecoder(self.incoming.clone())
    }
}

/// Writes a message's protobuf bytes.
#[derive(Debug)]
pub struct DynamicEncoder;

impl Encoder for DynamicEncoder {
    type Item = DynamicMessage;
    type Error = Status;

    fn encode(&mut self, item: DynamicMessage, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode(dst)
            .map_err(|e| Status::internal(format!("cannot encode the request: {e}")))
    }
}

/// Reads protobuf bytes as a message of one type.
#[derive(Debug)]
pub struct DynamicDecoder(MessageDescriptor);

impl Decoder for DynamicDecoder {
    type Item = DynamicMessage;
    type Error = Status;

    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<DynamicMessage>, Status> {
        DynamicMessage::decode(self.0.clone(), src)
            .map(Some)
            .map_err(|e| Status::internal(format!("the reply is not a valid message: {e}")))
    }
}
