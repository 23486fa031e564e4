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
            expected: "I32",
        });
    }
    let expected = match index {
        0 => "I32 [1, T] or [T]",
        6 => "I32 [n]",
        _ => "I32 [1]",
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
            expected: match ty {
                TensorType::Fp32 => "F32",
                TensorType::I64 => "I64",
                _ => "I32",
            },
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

/// Input 2, the sampling settings: `F32 [2]`, temperature and top_p, or `F32 [3]` with
/// min_p after them (0 without).
pub(super) fn sampling_values(index: u32, tensor: &Tensor) -> Result<(f32, f32, f32), Gpt2Error> {
    const EXPECTED: &str = "F32 [2] or [3]";
    if let Ok([t, p, m]) = fixed_words::<3, 4>(index, tensor, TensorType::Fp32, EXPECTED) {
        let [t, p, m] = [t, p, m].map(f32::from_le_bytes);
        return Ok((t, p, m));
    }
    let [t, p] = fixed_words::<2, 4>(index, tensor, TensorType::Fp32, EXPECTED)?;
    Ok((f32::from_le_bytes(t), f32::from_le_bytes(p), 0.0))
}

/// Input 4, the penalties: `F32 [3]`, presence, frequency and repetition.
pub(super) fn penalty_values(index: u32, tensor: &Tensor) -> Result<(f32, f32, f32), Gpt2Error> {
    let words = fixed_words::<3, 4>(index, tensor, TensorType::Fp32, "F32 [3]")?;
    let [presence, frequency, repetition] = words.map(f32::from_le_bytes);
    Ok((presence, frequency, repetition))
}

/// Input 7, the bias list's values: `F32 [n]` or `[1, n]` (n may be 0).
pub(super) fn f32_values(index: u32, tensor: &Tensor) -> Result<Vec<f32>, Gpt2Error> {
    if tensor.ty != TensorType::Fp32 {
        return Err(Gpt2Error::WrongTensorType {
            index,
            found: tensor.ty,
            expected: "F32",
        });
    }
    let elements = match tensor.dimensions[..] {
        [n] | [1, n] => n as usize,
        _ => usize::MAX,
    };
    if tensor.data.len() / 4 != elements || !tensor.data.len().is_multiple_of(4) {
        return Err(Gpt2Error::WrongShape {
            index,
            dims: tensor.dimensions.clone(),
            bytes: tensor.data.len(),
            expected: "F32 [n]",
        });
    }
    Ok(tensor
        .data
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect())
}

/// Inputs 1 and 5, one position: `I32 [1]`.
pub(super) fn i32_value(index: u32, tensor: &Tensor) -> Result<i32, Gpt2Error> {
    let [value] = fixed_words::<1, 4>(index, tensor, TensorType::I32, "I32 [1]")?;
    Ok(i32::from_le_bytes(value))
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
    use super::{f32_values, le_bytes, penalty_values, sampling_values, seed_value};
    use wasmtime_wasi_nn::wit::TensorType;
    use wasmtime_wasi_nn::Tensor;

    fn f32_tensor(dims: Vec<u32>, values: &[f32]) -> Tensor {
        let bytes = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        Tensor::new(dims, TensorType::Fp32, bytes)
    }

    #[test]
    fn sampling_inputs_are_read_and_checked() {
        let settings = f32_tensor(vec![2], &[0.8, 0.95]);
        assert_eq!(sampling_values(2, &settings).ok(), Some((0.8, 0.95, 0.0)));
        let batched = f32_tensor(vec![1, 2], &[0.8, 0.95]);
        assert_eq!(sampling_values(2, &batched).ok(), Some((0.8, 0.95, 0.0)));
        let with_min_p = f32_tensor(vec![3], &[0.8, 0.95, 0.1]);
        assert_eq!(sampling_values(2, &with_min_p).ok(), Some((0.8, 0.95, 0.1)));
        let bytes = settings.data.clone();
        for wrong in [
            Tensor::new(vec![3], TensorType::Fp32, bytes.clone()),
            Tensor::new(vec![2], TensorType::Fp32, bytes[..4].to_vec()),
            f32_tensor(vec![4], &[0.8, 0.95, 0.1, 0.0]),
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
    fn penalties_and_bias_values_are_read_and_checked() {
        let penalties = f32_tensor(vec![3], &[0.5, -0.25, 1.2]);
        assert_eq!(penalty_values(4, &penalties).ok(), Some((0.5, -0.25, 1.2)));
        assert!(penalty_values(4, &f32_tensor(vec![2], &[0.5, 0.1])).is_err());
        let values = f32_tensor(vec![1, 3], &[1.0, -100.0, 2.5]);
        assert_eq!(f32_values(7, &values).ok(), Some(vec![1.0, -100.0, 2.5]));
        assert_eq!(f32_values(7, &f32_tensor(vec![0], &[])).ok(), Some(vec![]));
        let short = Tensor::new(vec![3], TensorType::Fp32, vec![0; 8]);
        assert!(f32_values(7, &short).is_err());
        let ints = Tensor::new(vec![1], TensorType::I32, vec![0; 4]);
        assert!(f32_values(7, &ints).is_err());
        assert!(f32_values(7, &f32_tensor(vec![1, 1, 1], &[1.0])).is_err());
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
