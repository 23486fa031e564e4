//! A wasi-nn tensor's bytes to and from the values of the graph contract: the i32 inputs
//! (token ids, `logits_from`) checked against their shape, and f32 outputs as little-endian
//! bytes.

use super::Gpt2Error;
use wasmtime_wasi_nn::wit::TensorType;
use wasmtime_wasi_nn::Tensor;

/// The values of input `index`, an `I32` tensor whose dimensions match its data: `[1, T]` or
/// `[T]` (the ids) or `[1]`.
pub(super) fn i32_values(index: u32, tensor: &Tensor) -> Result<Vec<i32>, Gpt2Error> {
    if tensor.ty != TensorType::I32 {
        return Err(Gpt2Error::WrongTensorType {
            index,
            found: tensor.ty,
        });
    }
    let expected = if index == 0 {
        "I32 [1, T] or [T]"
    } else {
        "I32 [1]"
    };
    let wrong = || Gpt2Error::WrongShape {
        index,
        dims: tensor.dimensions.clone(),
        bytes: tensor.data.len(),
        expected,
    };
    let elements = match tensor.dimensions[..] {
        [t] => t as usize,
        [1, t] => t as usize,
        _ => return Err(wrong()),
    };
    if !tensor.data.len().is_multiple_of(4) || tensor.data.len() / 4 != elements {
        return Err(wrong());
    }
    Ok(tensor
        .data
        .chunks_exact(4)
        .map(|b| i32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// `values` as little-endian bytes: on little-endian machines one copy of their memory
/// (collecting each value's bytes through an iterator took 46 us for 50,257 logits on the GPU
/// machine's cores, a zeroed buffer filled four bytes at a time 114 us).
pub(super) fn le_bytes(values: &[f32]) -> Vec<u8> {
    if cfg!(target_endian = "little") {
        return bytemuck::cast_slice::<f32, u8>(values).to_vec();
    }
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

#[cfg(test)]
mod tests {
    use super::le_bytes;

    #[test]
    fn logits_become_their_little_endian_bytes() {
        let values = [
            0.0,
            -0.0,
            1.5,
            -3.25e-3,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::NAN,
            f32::MIN_POSITIVE / 2.0,
            f32::MAX,
        ];
        let want: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        assert_eq!(le_bytes(&values), want);
        assert!(le_bytes(&[]).is_empty());
    }
}
