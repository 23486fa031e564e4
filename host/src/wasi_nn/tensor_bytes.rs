//! A wasi-nn tensor's bytes to and from the values of the graph contract: the inputs (i32
//! token ids and `logits_from`, the f32 sampling settings, the i64 seed) checked against their
//! type and shape, and f32 outputs as little-endian bytes.

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

/// The `N` values of a tensor of type `ty` and dimensions `[N]` or `[1, N]`, as little-endian
/// words of `W` bytes.
fn fixed_words<const N: usize, const W: usize>(
    index: u32,
    tensor: &Tensor,
    ty: TensorType,
    expected: &'static str,
) -> Result<[[u8; W]; N], Gpt2Error> {
    if tensor.ty != ty {
        return Err(Gpt2Error::WrongTensorType {
            index,
            found: tensor.ty,
        });
    }
    let fits = matches!(tensor.dimensions[..], [n] | [1, n] if n as usize == N)
        && tensor.data.len() == N * W;
    if !fits {
        return Err(Gpt2Error::WrongShape {
            index,
            dims: tensor.dimensions.clone(),
            bytes: tensor.data.len(),
            expected,
        });
    }
    Ok(std::array::from_fn(|i| {
        std::array::from_fn(|b| tensor.data[i * W + b])
    }))
}

/// Input 2, the sampling settings: `F32 [2]`, temperature and top_p.
pub(super) fn sampling_values(index: u32, tensor: &Tensor) -> Result<(f32, f32), Gpt2Error> {
    let [t, p] = fixed_words::<2, 4>(index, tensor, TensorType::Fp32, "F32 [2]")?;
    Ok((f32::from_le_bytes(t), f32::from_le_bytes(p)))
}

/// Input 3, the seed: `I64 [1]` (its bits).
pub(super) fn seed_value(index: u32, tensor: &Tensor) -> Result<u64, Gpt2Error> {
    let [seed] = fixed_words::<1, 8>(index, tensor, TensorType::I64, "I64 [1]")?;
    Ok(u64::from_le_bytes(seed))
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
    use super::{le_bytes, sampling_values, seed_value};
    use wasmtime_wasi_nn::wit::TensorType;
    use wasmtime_wasi_nn::Tensor;

    #[test]
    fn sampling_inputs_are_read_and_checked() {
        let bytes: Vec<u8> = [0.8f32, 0.95]
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect();
        let settings = Tensor::new(vec![2], TensorType::Fp32, bytes.clone());
        assert_eq!(sampling_values(2, &settings).ok(), Some((0.8, 0.95)));
        let batched = Tensor::new(vec![1, 2], TensorType::Fp32, bytes.clone());
        assert_eq!(sampling_values(2, &batched).ok(), Some((0.8, 0.95)));
        for wrong in [
            Tensor::new(vec![3], TensorType::Fp32, bytes.clone()),
            Tensor::new(vec![2], TensorType::Fp32, bytes[..4].to_vec()),
            Tensor::new(vec![2], TensorType::I32, bytes),
        ] {
            assert!(sampling_values(2, &wrong).is_err());
        }
        let seed = Tensor::new(vec![1], TensorType::I64, (-2i64).to_le_bytes().to_vec());
        assert_eq!(seed_value(3, &seed).ok(), Some(u64::MAX - 1));
        let short = Tensor::new(vec![1], TensorType::I64, vec![0; 4]);
        assert!(seed_value(3, &short).is_err());
    }

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
