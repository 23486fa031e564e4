//! The batched attention's prompt tiles (`bt_attend` in `kernels/batch.cu`, bf16 mode): rows
//! of two prompts in tiles beside decode rows and padding, each context on its own cache,
//! against the CPU's attention of each row alone; and the same rows tiled another way give
//! the same bits.

use super::{pack_f16, Bench};
use wasi_nn_host::cpu;
use wasi_nn_host::cuda::buffer::{Act, DevBuf, DevPtr, Stored};
use wasi_nn_host::cuda::ops::batch::{
    tiles_fit, AttentionTiles, BatchAttention, RowTable, BATCH_ATT_SPAN, BATCH_ATT_SPLITS, BT_Q,
};
use wasi_nn_host::engine::EngineError;

/// One row of the check's pass: its position (-1: padding) and cache (0 or 1).
struct Row {
    pos: i32,
    cache: usize,
}

/// Rows 0..4 are the last rows of their inputs (decode, prompt B's, prompt A's, decode), then
/// prompt A's other rows (positions 0..a-1), prompt B's (b0..b0+4), and padding.
fn rows(a: usize, b0: usize, t: usize) -> Vec<Row> {
    let row = |pos: usize, cache| Row {
        pos: pos as i32,
        cache,
    };
    let mut rows = vec![row(31, 0), row(b0 + 5, 1), row(a - 1, 0), row(t - 1, 1)];
    rows.extend((0..a - 1).map(|p| row(p, 0)));
    rows.extend((b0..b0 + 5).map(|p| row(p, 1)));
    rows.extend((0..8).map(|_| Row { pos: -1, cache: 0 }));
    rows
}

/// The work, tiles, tile rows and tiled flags of `rows` with prompt A (rows 4..4+a-1, then 2)
/// cut into tiles of `cut` rows, and prompt B (rows 4+a-1.., then 1) in one tile.
fn tables(rows: &[Row], a: usize, cut: usize) -> Vec<i32> {
    let n = rows.len();
    let a_rows: Vec<i32> = (4..4 + a as i32 - 1).chain([2]).collect();
    let b_first = 4 + a as i32 - 1;
    let b_rows: Vec<i32> = (b_first..b_first + 5).chain([1]).collect();
    let (mut work, mut tiles, mut tile_rows) = (Vec::new(), Vec::new(), Vec::new());
    for tile in a_rows.chunks(cut).chain([&b_rows[..]]) {
        work.push(-2 - (tiles.len() / 2) as i32);
        tiles.extend([tile_rows.len() as i32, tile.len() as i32]);
        tile_rows.extend_from_slice(tile);
    }
    let mut tiled = vec![0; n];
    tile_rows.iter().for_each(|&r| tiled[r as usize] = 1);
    // the decode rows and the padding keep blocks of their own
    work.extend([0, 3]);
    work.extend((0..n).filter(|&r| rows[r].pos < 0).map(|r| r as i32));
    work.resize(n, -1);
    let pad = |mut v: Vec<i32>| {
        v.resize(n, 0);
        v
    };
    [work, pad(tiles), pad(tile_rows), tiled].concat()
}

/// Runs the check on the workbench's model (bf16, heads of 32 or 64 dimensions); `(keys, values)` fill the first cache, swapped the second.
pub(super) fn check_tiles(
    b: &mut Bench,
    (keys, values): (&[f32], &[f32]),
    qkv_b: (&[f32], DevPtr<Stored>),
    report: &mut impl FnMut(&str, &[f32], &[f32], f32),
) -> Result<(), EngineError> {
    let cfg = b.l.config();
    let (c, t, hd) = (cfg.n_embd, cfg.n_ctx, cfg.head_dim());
    if !tiles_fit(b.l.dtype(), hd) || t < 48 {
        return Ok(());
    }
    let stream = b.l.stream().clone();
    // prompt A: 40 rows from position 0; prompt B: 6 rows mid-context
    let (a, b0) = (40, t / 2 - 6);
    let rows = rows(a, b0, t);
    let n = rows.len();
    let tmp_values = b.random(2 * n * 3 * c);
    let tmp = DevBuf::from_host(&stream, &tmp_values, "product rows")?;
    let caches = [
        (
            DevBuf::from_host(&stream, &pack_f16(keys), "KV cache")?,
            DevBuf::from_host(&stream, &pack_f16(values), "KV cache")?,
        ),
        (
            DevBuf::from_host(&stream, &pack_f16(values), "KV cache")?,
            DevBuf::from_host(&stream, &pack_f16(keys), "KV cache")?,
        ),
    ];
    let cpu_caches = [(keys, values), (values, keys)];
    let ints: Vec<i32> = std::iter::repeat_n(0, n)
        .chain(rows.iter().map(|r| r.pos))
        .collect();
    let addrs: Vec<u64> = (rows.iter().map(|r| caches[r.cache].0.ptr().addr()))
        .chain(rows.iter().map(|r| caches[r.cache].1.ptr().addr()))
        .chain(std::iter::repeat_n(0, n))
        .collect();
    let ints = DevBuf::from_host(&stream, &ints, "table")?;
    let addrs = DevBuf::from_host(&stream, &addrs, "table")?;
    let keys_buf = DevBuf::<u64>::zeros(&stream, n, "table")?;
    let partial = DevBuf::<f32>::zeros(
        &stream,
        n * cfg.n_head * BATCH_ATT_SPLITS * (hd + 2),
        "partial",
    )?;
    // each row alone on the CPU over its own cache, every key already there
    let mut want = vec![0.0; n * c];
    for (r, row) in rows.iter().enumerate() {
        if row.pos < 0 {
            continue; // a padding row gives zeros
        }
        let mut q: Vec<f32> = tmp_values[r * 3 * c..][..c].to_vec();
        let lo = &tmp_values[(n + r) * 3 * c..][..c];
        q.iter_mut()
            .zip(lo)
            .zip(qkv_b.0)
            .for_each(|((q, l), bias)| *q += l + bias);
        let (k, v) = cpu_caches[row.cache];
        let out = &mut want[r * c..(r + 1) * c];
        cpu::attention_row(out, &q, (k, v), row.pos as usize + 1, cfg.n_head);
    }
    let mut first_cut = None;
    for (cut, splits) in [
        (BT_Q as usize, 1),
        (BT_Q as usize, BATCH_ATT_SPLITS),
        (5, 1),
    ] {
        let tables = DevBuf::from_host(&stream, &tables(&rows, a, cut), "tiles")?;
        let section = |i: usize| tables.ptr().skip(i * n);
        let mut table: RowTable = super::row_table(n, (&ints, &addrs, &keys_buf), t * c);
        table.tiles = Some(AttentionTiles {
            work: section(0),
            tiles: section(1),
            tile_rows: section(2),
            tiled: section(3),
        });
        let attention = BatchAttention {
            out: Act::Bf16(b.x_bf16()?),
            tmp: tmp.ptr(),
            bias: qkv_b.1,
            split: true,
            parts: 1,
            partial: partial.ptr(),
            layer: 0,
            splits,
            span: BATCH_ATT_SPAN,
            append: false,
        };
        b.l.batch_attention(&table, attention)?;
        let halves = b.get_bf16(2 * n * c)?;
        let (hi, lo) = halves.split_at(n * c);
        let got: Vec<f32> = hi.iter().zip(lo).map(|(h, l)| h + l).collect();
        let name = format!("attention batched, prompts in tiles of {cut}, spans={splits}");
        report(&name, &got, &want, 2e-4);
        // prompt A's rows: the same bits however the prompt is cut into tiles
        let a_rows: Vec<f32> = (2..3)
            .chain(4..4 + a - 1)
            .flat_map(|r| got[r * c..(r + 1) * c].to_vec())
            .collect();
        match &first_cut {
            None => first_cut = Some(a_rows),
            Some(before) => report(
                &format!("attention batched: a prompt row's bits in tiles of {cut} and of {BT_Q}"),
                &a_rows,
                before,
                0.0,
            ),
        }
    }
    Ok(())
}
