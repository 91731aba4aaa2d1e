//! The protobuf codec of agents.v1: prost's, with a smaller first buffer
//! for each response stream.
//!
//! tonic gives every response stream an encode buffer of 8 KiB from its
//! start. A Run waiting on its model or a tool holds it untouched for as
//! long as it waits, and thousands of them wait at once; the buffer grows
//! to what a burst of events needs as soon as they come (up to the
//! 32 KiB at which tonic hands a frame on, as before).

use std::marker::PhantomData;

use tonic::codec::{BufferSettings, Codec};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

/// The first capacity of a response stream's encode buffer.
const FIRST_BUFFER: usize = 1024;
/// tonic's own: encoded messages are handed on once this many bytes wait.
const YIELD_THRESHOLD: usize = 32 * 1024;

/// [`ProstCodec`] with a [`FIRST_BUFFER`]-byte encode buffer.
#[derive(Debug, Clone, Copy)]
pub struct SmallBufferCodec<T, U>(PhantomData<(T, U)>);

impl<T, U> Default for SmallBufferCodec<T, U> {
    fn default() -> Self {
        Self(PhantomData)
    }
}

impl<T, U> Codec for SmallBufferCodec<T, U>
where
    T: prost::Message + Send + 'static,
    U: prost::Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = ProstEncoder<T>;
    type Decoder = ProstDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        ProstCodec::<T, U>::raw_encoder(BufferSettings::new(FIRST_BUFFER, YIELD_THRESHOLD))
    }

    fn decoder(&mut self) -> Self::Decoder {
        ProstCodec::<T, U>::raw_decoder(BufferSettings::default())
    }
}

#[cfg(test)]
mod tests {
    use tonic::codec::Encoder as _;

    use super::*;
    use crate::pb;

    /// Response streams start with a small buffer and still hand frames on
    /// at tonic's threshold.
    #[test]
    fn the_encoder_starts_small_and_yields_where_tonic_does() {
        let mut codec = SmallBufferCodec::<pb::AgentEvent, pb::RunRequest>::default();
        let settings = format!("{:?}", codec.encoder().buffer_settings());
        assert_eq!(
            settings,
            format!("{:?}", BufferSettings::new(1024, 32 * 1024))
        );
        assert_ne!(
            settings,
            format!("{:?}", BufferSettings::default()),
            "not tonic's 8 KiB"
        );
    }
}
