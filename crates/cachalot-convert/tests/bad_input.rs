//! Bad inputs are reported by file and tensor before anything is written; the output directory
//! only ever appears complete.

use std::fs;
use std::path::{Path, PathBuf};

use cachalot_convert::{convert, ignore_list, ignored, read_header, ConvertOptions, QuantMode};
use safetensors::tensor::{Dtype, TensorView};

mod common;

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/v3/r1_tiny")
}

fn v4_fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../fixtures/v4/tiny")
}

fn copy_fixture(to: &Path) {
    copy_dir(&fixture(), to)
}

fn copy_dir(from: &Path, to: &Path) {
    fs::create_dir_all(to).unwrap();
    for e in fs::read_dir(from).unwrap() {
        let p = e.unwrap().path();
        fs::copy(&p, to.join(p.file_name().unwrap())).unwrap();
    }
}

fn opts(input: &Path, output: &Path) -> ConvertOptions {
    ConvertOptions {
        input: input.to_path_buf(),
        output: output.to_path_buf(),
        mode: QuantMode::W8A8C16,
        c8_scales: None,
        quant_param_path: None,
        force: false,
        progress: false,
    }
}

fn expect_error(input: &Path, output: &Path, parts: &[&str]) {
    expect_error_in(input, output, QuantMode::W8A8C16, parts)
}

fn expect_error_in(input: &Path, output: &Path, mode: QuantMode, parts: &[&str]) {
    let mut o = opts(input, output);
    o.mode = mode;
    let e = convert(&o).expect_err("conversion must fail");
    let msg = e.to_string();
    for p in parts {
        assert!(msg.contains(p), "error `{msg}` does not mention `{p}`");
    }
    assert!(
        !output.exists(),
        "a failed conversion left {}",
        output.display()
    );
    let parent = output.parent().unwrap();
    for e in fs::read_dir(parent).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        assert!(!name.contains(".partial-"), "temporary {name} left behind");
    }
}

/// Rewrites one shard of `dir` with `edit` applied to its (name, dtype, shape, bytes) list.
fn rewrite_shard(
    dir: &Path,
    file: &str,
    edit: impl FnOnce(&mut Vec<(String, Dtype, Vec<usize>, Vec<u8>)>),
) {
    let path = dir.join(file);
    let bytes = fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, t)| (n, t.dtype(), t.shape().to_vec(), t.data().to_vec()))
        .collect();
    edit(&mut tensors);
    let views: Vec<(String, TensorView)> = tensors
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

fn shard_of(dir: &Path, tensor: &str) -> String {
    let index: serde_json::Value = serde_json::from_str(
        &fs::read_to_string(dir.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    index["weight_map"][tensor].as_str().unwrap().to_string()
}

#[test]
fn missing_scale_inv_names_the_weight_and_file() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in");
    copy_fixture(&input);
    let scale = "model.layers.1.self_attn.o_proj.weight_scale_inv";
    let file = shard_of(&input, scale);
    rewrite_shard(&input, &file, |t| t.retain(|(n, ..)| n != scale));
    // The index still names it: that alone is reported.
    expect_error(
        &input,
        &tmp.path().join("out"),
        &[scale, "model.safetensors.index.json", "not in this shard"],
    );
    // Without the index entry, the weight is reported.
    let ip = input.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&ip).unwrap()).unwrap();
    index["weight_map"].as_object_mut().unwrap().remove(scale);
    fs::write(&ip, index.to_string()).unwrap();
    let weight = "model.layers.1.self_attn.o_proj.weight";
    expect_error(
        &input,
        &tmp.path().join("out"),
        &[weight, scale, "in no shard"],
    );
}

#[test]
fn wrong_dtypes_are_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in");
    copy_fixture(&input);
    let name = "model.layers.0.self_attn.q_a_proj.weight";
    let file = shard_of(&input, name);
    rewrite_shard(&input, &file, |t| {
        for x in t.iter_mut().filter(|x| x.0 == name) {
            x.1 = Dtype::I8;
        }
    });
    expect_error(&input, &tmp.path().join("out"), &[name, &file, "I8"]);

    let input2 = tmp.path().join("in2");
    copy_fixture(&input2);
    let scale = "model.layers.0.self_attn.q_a_proj.weight_scale_inv";
    let file = shard_of(&input2, scale);
    rewrite_shard(&input2, &file, |t| {
        for x in t.iter_mut().filter(|x| x.0 == scale) {
            x.1 = Dtype::BF16;
            x.2 = vec![x.3.len() / 2];
        }
    });
    expect_error(&input2, &tmp.path().join("out"), &[scale, "expected F32"]);
}

#[test]
fn index_naming_a_missing_shard_and_truncated_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in");
    copy_fixture(&input);
    let ip = input.join("model.safetensors.index.json");
    let text = fs::read_to_string(&ip).unwrap();
    fs::write(
        &ip,
        text.replacen(
            "model-00002-of-00003.safetensors",
            "model-00009-of-00009.safetensors",
            1,
        ),
    )
    .unwrap();
    expect_error(
        &input,
        &tmp.path().join("out"),
        &["model-00009-of-00009.safetensors"],
    );

    let input2 = tmp.path().join("in2");
    copy_fixture(&input2);
    let shard = input2.join("model-00003-of-00003.safetensors");
    let len = fs::metadata(&shard).unwrap().len();
    fs::OpenOptions::new()
        .write(true)
        .open(&shard)
        .unwrap()
        .set_len(len - 1000)
        .unwrap();
    expect_error(
        &input2,
        &tmp.path().join("out"),
        &["model-00003-of-00003.safetensors", "truncated"],
    );
}

#[test]
fn refuses_a_non_empty_output_without_force() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    fs::create_dir_all(&out).unwrap();
    fs::write(out.join("keep.txt"), "mine").unwrap();
    let e = convert(&opts(&fixture(), &out)).unwrap_err();
    assert!(e.to_string().contains("--force"), "{e}");
    assert!(out.join("keep.txt").exists());
    // An existing directory is written into, not replaced (a shell in it stays in the output;
    // its mode stays), as the seed's converter does.
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let ino = |d: &Path| fs::metadata(d).unwrap().ino();
    let before = ino(&out);
    let mut o = opts(&fixture(), &out);
    o.force = true;
    convert(&o).unwrap();
    assert!(!out.join("keep.txt").exists());
    assert!(out.join("config.json").exists());
    assert_eq!(ino(&out), before);
    // An empty directory is fine without --force.
    let empty = tmp.path().join("empty");
    fs::create_dir_all(&empty).unwrap();
    fs::set_permissions(&empty, fs::Permissions::from_mode(0o2750)).unwrap();
    let before = ino(&empty);
    convert(&opts(&fixture(), &empty)).unwrap();
    assert_eq!(ino(&empty), before);
    let mode = fs::metadata(&empty).unwrap().permissions().mode();
    assert_eq!(mode & 0o7777, 0o2750, "{mode:o}");
    for d in [&out, &empty] {
        for e in fs::read_dir(d).unwrap() {
            let name = e.unwrap().file_name().to_string_lossy().into_owned();
            assert!(!name.starts_with('.'), "{name} left behind");
        }
    }
}

#[test]
fn refuses_an_output_that_is_or_holds_the_input_even_with_force() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in");
    copy_fixture(&input);
    fs::write(tmp.path().join("notes.txt"), "mine").unwrap();
    for out in [
        input.clone(),
        tmp.path().to_path_buf(),
        input.join("..").join("in"),
        input.join("."),
    ] {
        for mode in [QuantMode::W8A8C16, QuantMode::Bfloat16] {
            let mut o = opts(&input, &out);
            o.force = true;
            o.mode = mode;
            let e = convert(&o).unwrap_err().to_string();
            assert!(e.contains("holds it") && e.contains("--output"), "{e}");
        }
    }
    assert!(input.join("config.json").exists() && tmp.path().join("notes.txt").exists());
    // A sibling directory is fine.
    let mut o = opts(&input, &tmp.path().join("out"));
    o.force = true;
    convert(&o).unwrap();
}

#[test]
fn nan_fp8_codes_are_named_not_converted() {
    for mode in [QuantMode::W8A8C16, QuantMode::Bfloat16] {
        let tmp = tempfile::tempdir().unwrap();
        let input = tmp.path().join("in");
        copy_fixture(&input);
        let name = "model.layers.1.self_attn.o_proj.weight";
        let shard = shard_of(&input, name);
        rewrite_shard(&input, &shard, |t| {
            let w = t.iter_mut().find(|(n, ..)| n == name).unwrap();
            w.3[7] = 0xFF;
        });
        expect_error_in(
            &input,
            &tmp.path().join("out"),
            mode,
            &[name, &shard, "NaN", "column 7"],
        );
    }
    // The V4 converter too, whatever the target format.
    for mode in [
        QuantMode::Bfloat16,
        QuantMode::W8A8Int,
        QuantMode::W4A8Mx,
        QuantMode::W4A8MxHif,
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let input = tmp.path().join("in");
        copy_dir(&v4_fixture(), &input);
        let name = "layers.0.attn.wq_b.weight";
        let shard = shard_of(&input, name);
        rewrite_shard(&input, &shard, |t| {
            let w = t.iter_mut().find(|(n, ..)| n == name).unwrap();
            w.3[5] = 0x7F;
        });
        // The input shard is named (not the output's partial copy of it).
        let path = input.join(&shard).display().to_string();
        expect_error_in(
            &input,
            &tmp.path().join("out"),
            mode,
            &[name, &path, "NaN", "column 5"],
        );
    }
}

/// A block scale so large that the dequantized weight overflows bf16 is named (it would be
/// written as an infinite weight or int8 scale).
#[test]
fn overflowing_block_scales_are_named() {
    for mode in [QuantMode::W8A8C16, QuantMode::Bfloat16] {
        let tmp = tempfile::tempdir().unwrap();
        let input = tmp.path().join("in");
        copy_fixture(&input);
        let name = "model.layers.1.self_attn.o_proj.weight_scale_inv";
        let shard = shard_of(&input, name);
        rewrite_shard(&input, &shard, |t| {
            let w = t.iter_mut().find(|(n, ..)| n == name).unwrap();
            w.3[..4].copy_from_slice(&3e38f32.to_le_bytes());
        });
        expect_error_in(
            &input,
            &tmp.path().join("out"),
            mode,
            &["model.layers.1.self_attn.o_proj.weight", "overflows bf16"],
        );
    }
}

/// A NaN or infinity in a tensor the converter copies as it is (bf16 embedding) is named,
/// not carried into the output; in both converters.
#[test]
fn non_finite_copied_tensors_are_named_not_converted() {
    for (v4, name, bits) in [
        (false, "model.embed_tokens.weight", [0xC0u8, 0x7F]),
        (true, "embed.weight", [0x80, 0x7F]),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let input = tmp.path().join("in");
        if v4 {
            copy_dir(&v4_fixture(), &input);
        } else {
            copy_fixture(&input);
        }
        let shard = shard_of(&input, name);
        rewrite_shard(&input, &shard, |t| {
            let w = t.iter_mut().find(|(n, ..)| n == name).unwrap();
            assert_eq!(w.1, Dtype::BF16, "{name}");
            w.3[6..8].copy_from_slice(&bits);
        });
        let mode = if v4 {
            QuantMode::Bfloat16
        } else {
            QuantMode::W8A8C16
        };
        let path = input.join(&shard).display().to_string();
        expect_error_in(
            &input,
            &tmp.path().join("out"),
            mode,
            &[name, &path, "NaN or infinite", "element 3"],
        );
    }
}

#[test]
fn c8_needs_a_scale_per_layer() {
    let tmp = tempfile::tempdir().unwrap();
    let scales = tmp.path().join("s.json");
    fs::write(&scales, r#"{"ckv_scale": [0.1, 0.2]}"#).unwrap();
    let mut o = opts(&fixture(), &tmp.path().join("out"));
    o.mode = QuantMode::W8A8C8;
    o.c8_scales = Some(scales.clone());
    let e = convert(&o).unwrap_err().to_string();
    assert!(e.contains("4 layers") && e.contains("s.json"), "{e}");
    o.c8_scales = None;
    assert!(convert(&o).unwrap_err().to_string().contains("calibrate"));
}

/// DeepSeek-V4 (spec `deepseek-v4.md` §4.1–§4.2): a missing or misshapen `.scale`, a 1-byte dtype
/// the native checkpoint does not have, a V3 mode (and V4 types on V3), all before writing.
#[test]
fn v4_bad_inputs_are_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in");
    copy_dir(&v4_fixture(), &input);
    let out = tmp.path().join("out");
    expect_error_in(
        &input,
        &out,
        QuantMode::W8A8C16,
        &["w8a8c16", "DeepSeek-V4", "--quant-type"],
    );
    // V4 types on a V3 checkpoint.
    expect_error_in(
        &fixture(),
        &out,
        QuantMode::W4A8Mx,
        &["w4a8-mx", "not a V4 checkpoint"],
    );

    // A misshapen expert scale (FP4: [F, D/32]).
    let scale = "layers.0.ffn.experts.1.w2.scale";
    let file = shard_of(&input, scale);
    rewrite_shard(&input, &file, |t| {
        let s = t.iter_mut().find(|(n, ..)| n == scale).unwrap();
        s.2 = vec![s.2[0] / 2, s.2[1] * 2];
    });
    expect_error_in(
        &input,
        &out,
        QuantMode::W4A8Int,
        &[
            scale,
            "has shape",
            "layers.0.ffn.experts.1.w2.weight",
            &file,
        ],
    );

    // A missing FP8 scale (and its index entry).
    copy_dir(&v4_fixture(), &input);
    let scale = "layers.1.attn.wo_b.scale";
    let file = shard_of(&input, scale);
    rewrite_shard(&input, &file, |t| t.retain(|(n, ..)| n != scale));
    let ip = input.join("model.safetensors.index.json");
    let mut index: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&ip).unwrap()).unwrap();
    index["weight_map"].as_object_mut().unwrap().remove(scale);
    fs::write(&ip, index.to_string()).unwrap();
    expect_error_in(
        &input,
        &out,
        QuantMode::Bfloat16,
        &["layers.1.attn.wo_b.weight", scale, "in no shard"],
    );

    // A U8 weight (already converted?).
    copy_dir(&v4_fixture(), &input);
    let w = "layers.0.ffn.experts.0.w1.weight";
    let file = shard_of(&input, w);
    rewrite_shard(&input, &file, |t| {
        t.iter_mut().find(|(n, ..)| n == w).unwrap().1 = Dtype::U8;
    });
    expect_error_in(
        &input,
        &out,
        QuantMode::W8A8Int,
        &[w, "U8", "already converted"],
    );
}

/// Writes a safetensors file by hand: `header` verbatim (space-padded to a multiple of 8), then
/// `data_len` zero bytes of data.
fn write_raw_shard(path: &Path, header: &str, data_len: usize) {
    let mut h = header.as_bytes().to_vec();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut bytes = (h.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(&h);
    bytes.resize(bytes.len() + data_len, 0);
    fs::write(path, bytes).unwrap();
}

/// `read_header` of a hand-written shard fails, naming the file and saying `parts`.
fn header_error(header: &str, data_len: usize, parts: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("shard.safetensors");
    write_raw_shard(&path, header, data_len);
    let msg = match read_header(&path) {
        Ok(t) => panic!("header {header} with {data_len} data bytes was accepted: {t:?}"),
        Err(e) => e.to_string(),
    };
    for p in parts.iter().chain(&["shard.safetensors"]) {
        assert!(msg.contains(p), "error `{msg}` does not mention `{p}`");
    }
}

/// The converter's own header reader: sizes in checked arithmetic (a shape whose byte count
/// wraps to 0 is not an empty tensor), offsets within the data section, and tensors that tile
/// it without overlaps or holes, as the safetensors format (and the runtime's loader) require.
#[test]
fn bogus_safetensors_headers_are_reported() {
    // A valid layout (a zero-size tensor between two others) is read.
    let tmp = tempfile::tempdir().unwrap();
    let ok = tmp.path().join("ok.safetensors");
    write_raw_shard(
        &ok,
        r#"{"__metadata__":{"format":"pt"},
            "a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
            "e":{"dtype":"BF16","shape":[0,3],"data_offsets":[8,8]},
            "b":{"dtype":"BF16","shape":[1,2],"data_offsets":[8,12]}}"#,
        12,
    );
    let t = read_header(&ok).unwrap();
    assert_eq!(t.len(), 3);
    assert_eq!(t[2].1.end - t[2].1.start, 4);

    // 2^62 · 4 elements · 2 bytes wraps to 0 bytes.
    header_error(
        r#"{"a":{"dtype":"BF16","shape":[4611686018427387904,4],"data_offsets":[0,0]}}"#,
        0,
        &["tensor a", "[4611686018427387904, 4]", "overflows"],
    );
    header_error(
        r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}"#,
        4,
        &[
            "tensor a",
            "data_offsets [0, 4] hold 4 bytes",
            "F32 needs 8",
        ],
    );
    header_error(
        r#"{"a":{"dtype":"F32","shape":[0],"data_offsets":[8,0]}}"#,
        8,
        &["tensor a", "[8, 0]", "end before they begin"],
    );
    header_error(
        r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}"#,
        4,
        &[
            "tensor a",
            "end 8 is past the file's data section of 4 bytes",
            "truncated",
        ],
    );
    // Offsets near 2^64 that wrapped back into the file.
    header_error(
        r#"{"a":{"dtype":"U8","shape":[1],"data_offsets":[18446744073709551614,18446744073709551615]}}"#,
        8,
        &[
            "tensor a",
            "end 18446744073709551615 is past the file's data section of 8 bytes",
        ],
    );
    header_error(
        r#"{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},
            "b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}"#,
        8,
        &["tensor b", "[4, 8]", "overlap", "tensor a", "[0, 8]"],
    );
    header_error(
        r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},
            "b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}"#,
        12,
        &["tensor b", "bytes 4..8", "contiguous"],
    );
    header_error(
        r#"{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}"#,
        8,
        &["4 trailing bytes"],
    );

    // Through `convert`: reported before anything is written.
    let input = tmp.path().join("in");
    copy_fixture(&input);
    let file = "model-00001-of-00003.safetensors";
    write_raw_shard(
        &input.join(file),
        r#"{"model.embed_tokens.weight":{"dtype":"BF16","shape":[4611686018427387904,4],"data_offsets":[0,0]}}"#,
        0,
    );
    expect_error(
        &input,
        &tmp.path().join("out"),
        &[file, "model.embed_tokens.weight", "overflows"],
    );
}

/// An FP8 weight with a zero dimension (and a matching empty scale grid) is a corrupt header,
/// reported while planning; it used to reach `chunks_exact(0)` while quantising.
#[test]
fn zero_sized_weights_are_reported() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("out");
    let empty = |dir: &Path, name: &str, shape: Vec<usize>| {
        let file = shard_of(dir, name);
        rewrite_shard(dir, &file, |t| {
            let x = t.iter_mut().find(|(n, ..)| n == name).unwrap();
            x.2 = shape;
            x.3.clear();
        });
        file
    };

    // DeepSeek-V3: F8_E4M3 [4, 0] with F32 [1, 0] block scales.
    let input = tmp.path().join("in");
    copy_fixture(&input);
    let w = "model.layers.0.self_attn.o_proj.weight";
    let file = empty(&input, w, vec![4, 0]);
    empty(&input, &format!("{w}_scale_inv"), vec![1, 0]);
    expect_error(
        &input,
        &out,
        &[w, &file, "[4, 0]", "weights need non-zero dimensions"],
    );

    // DeepSeek-V4: F8_E4M3 [4, 0] with E8M0 [1, 0] scales, quantised to INT8.
    let input = tmp.path().join("in4");
    copy_dir(&v4_fixture(), &input);
    let w = "layers.0.attn.wo_b.weight";
    let file = empty(&input, w, vec![4, 0]);
    empty(&input, "layers.0.attn.wo_b.scale", vec![1, 0]);
    expect_error_in(
        &input,
        &out,
        QuantMode::W8A8Int,
        &[w, &file, "[4, 0]", "weights need non-zero dimensions"],
    );
}

/// `--output` with `.` or `..` in it is the directory it names once resolved: `--force`
/// replaces that directory whole, and only once the new output is complete.
#[test]
fn output_paths_with_dots_are_resolved() {
    let tmp = tempfile::tempdir().unwrap();
    let a = tmp.path().join("a");
    fs::create_dir_all(a.join("b")).unwrap();
    fs::write(a.join("notes.txt"), "old").unwrap();
    let mut o = opts(&fixture(), &a.join("b").join(".."));
    // Not empty: refused without --force, untouched.
    assert!(convert(&o).unwrap_err().to_string().contains("--force"));
    assert!(a.join("notes.txt").exists());
    o.force = true;
    convert(&o).unwrap();
    assert!(a.join("config.json").is_file() && !a.join("notes.txt").exists());
    // Into a directory by `DIR/.`.
    let c = tmp.path().join("c");
    fs::create_dir_all(&c).unwrap();
    convert(&opts(&fixture(), &c.join("."))).unwrap();
    assert!(c.join("model.safetensors.index.json").is_file());
    for e in fs::read_dir(tmp.path()).unwrap() {
        let name = e.unwrap().file_name().to_string_lossy().into_owned();
        assert!(!name.starts_with('.'), "{name} left behind");
    }
    // A file where the path wants a directory is said so.
    let file = tmp.path().join("afile");
    fs::write(&file, "x").unwrap();
    let e = convert(&opts(&fixture(), &file.join("sub"))).unwrap_err();
    assert!(e.to_string().contains("is a file, not a directory"), "{e}");
    // The root is refused by name.
    let e = convert(&opts(&fixture(), Path::new("/"))).unwrap_err();
    assert!(e.to_string().contains("root"), "{e}");
}

/// Files other than weights come along (a Kimi tokenizer's `tiktoken.model`, a Jinja
/// template, a model card, subdirectories); weight files in other formats do not.
#[test]
fn tokenizer_and_template_files_come_along() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in");
    copy_fixture(&input);
    fs::write(input.join("tiktoken.model"), "abc 0\n").unwrap();
    fs::write(input.join("chat_template.jinja"), "{{ x }}").unwrap();
    fs::create_dir_all(input.join("original")).unwrap();
    fs::write(input.join("original/notes.md"), "card").unwrap();
    fs::write(input.join("pytorch_model.bin"), "weights").unwrap();
    fs::write(input.join(".hidden"), "x").unwrap();
    let out = tmp.path().join("out");
    convert(&opts(&input, &out)).unwrap();
    for f in ["tiktoken.model", "chat_template.jinja", "original/notes.md"] {
        assert!(out.join(f).is_file(), "{f} was not copied");
    }
    for f in ["pytorch_model.bin", ".hidden"] {
        assert!(!out.join(f).exists(), "{f} was copied");
    }
}

/// A BF16 checkpoint (DeepSeek's FP8 weights cast to bf16, with or without the FP8
/// `quantization_config` left in config.json) converts to W8A8 as its FP8 source does,
/// tensor for tensor.
#[test]
fn bf16_checkpoints_quantize_as_their_fp8_source() {
    let tmp = tempfile::tempdir().unwrap();
    let bf16 = tmp.path().join("bf16");
    let mut o = opts(&fixture(), &bf16);
    o.mode = QuantMode::Bfloat16;
    convert(&o).unwrap();
    let from_fp8 = tmp.path().join("from_fp8");
    convert(&opts(&fixture(), &from_fp8)).unwrap();
    let from_bf16 = tmp.path().join("from_bf16");
    convert(&opts(&bf16, &from_bf16)).unwrap();
    assert_eq!(
        common::summarize(&from_fp8)
            .into_iter()
            .map(|(n, v)| (n, v[1].clone(), v[2].clone(), v[3].clone()))
            .collect::<Vec<_>>(),
        common::summarize(&from_bf16)
            .into_iter()
            .map(|(n, v)| (n, v[1].clone(), v[2].clone(), v[3].clone()))
            .collect::<Vec<_>>()
    );
    // The FP8 config left beside bf16 tensors.
    fs::copy(fixture().join("config.json"), bf16.join("config.json")).unwrap();
    let again = tmp.path().join("again");
    convert(&opts(&bf16, &again)).unwrap();
    assert_eq!(common::summarize(&again), common::summarize(&from_bf16));
    // `"quantization_config": null` is none (as transformers reads it).
    let mut config: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(fixture().join("config.json")).unwrap()).unwrap();
    config["quantization_config"] = serde_json::Value::Null;
    fs::write(bf16.join("config.json"), config.to_string()).unwrap();
    let null = tmp.path().join("null");
    convert(&opts(&bf16, &null)).unwrap();
    assert_eq!(common::summarize(&null), common::summarize(&from_bf16));
    // The same values stored as F32 (exact): the same int8 weights and scales.
    let f32_dir = tmp.path().join("f32");
    copy_dir(&bf16, &f32_dir);
    for e in fs::read_dir(&f32_dir).unwrap() {
        let file = e.unwrap().file_name().to_string_lossy().into_owned();
        if !file.ends_with(".safetensors") {
            continue;
        }
        rewrite_shard(&f32_dir, &file, |t| {
            for (_, d, _, b) in t.iter_mut() {
                if *d == Dtype::BF16 {
                    *d = Dtype::F32;
                    *b = b
                        .chunks_exact(2)
                        .flat_map(|c| {
                            ((u16::from_le_bytes([c[0], c[1]]) as u32) << 16).to_le_bytes()
                        })
                        .collect();
                }
            }
        });
    }
    let from_f32 = tmp.path().join("from_f32");
    convert(&opts(&f32_dir, &from_f32)).unwrap();
    let int8 = |d: &Path| {
        common::summarize(d)
            .into_iter()
            .filter(|(_, v)| v[1] == "I8" || v[0].as_str().is_some_and(|_| false))
            .map(|(n, v)| (n, v[3].clone()))
            .collect::<Vec<_>>()
    };
    assert!(!int8(&from_f32).is_empty());
    assert_eq!(int8(&from_f32), int8(&from_bf16));
    // And to bf16: the bf16 checkpoint again, tensor for tensor (every float tensor rounded
    // to bf16, which gives back these values; the router's correction bias stays F32).
    let back = tmp.path().join("back");
    let mut o = opts(&f32_dir, &back);
    o.mode = QuantMode::Bfloat16;
    convert(&o).unwrap();
    assert_eq!(common::summarize(&back), common::summarize(&bf16));
}

/// The ignore list names modules: `model.layers.3.mlp.gate` (the seed's router entry) keeps
/// the router but not a dense layer's `gate_proj`.
#[test]
fn the_ignore_list_matches_modules_not_substrings() {
    let ignore = ignore_list(5, 6);
    assert!(ignored(&ignore, "model.layers.3.mlp.gate.weight"));
    assert!(!ignored(&ignore, "model.layers.3.mlp.gate_proj.weight"));
    assert!(ignored(
        &ignore,
        "model.layers.2.self_attn.kv_b_proj.weight"
    ));
    assert!(ignored(&ignore, "model.layers.5.eh_proj.weight"));
    assert!(ignored(&ignore, "lm_head.weight"));
    assert!(!ignored(
        &ignore,
        "model.layers.1.self_attn.kv_b_proj_x.weight"
    ));
}

/// A config without `num_nextn_predict_layers` (the runtime then takes the MTP layer the
/// checkpoint holds): the MTP layer's modules are in the ignore list as where the key is given
/// (its `kv_b_proj` stays bf16).
#[test]
fn the_ignore_list_counts_the_mtp_layer_a_config_leaves_out() {
    let tmp = tempfile::tempdir().unwrap();
    let with = tmp.path().join("with");
    convert(&opts(&fixture(), &with)).unwrap();
    let input = tmp.path().join("in");
    copy_fixture(&input);
    let cfg_path = input.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&cfg_path).unwrap()).unwrap();
    assert_eq!(cfg["num_nextn_predict_layers"], 1);
    cfg.as_object_mut()
        .unwrap()
        .remove("num_nextn_predict_layers");
    fs::write(&cfg_path, cfg.to_string()).unwrap();
    let without = tmp.path().join("without");
    convert(&opts(&input, &without)).unwrap();
    let ignore = |d: &Path| {
        let v: serde_json::Value =
            serde_json::from_str(&fs::read_to_string(d.join("config.json")).unwrap()).unwrap();
        v["quantization_config"]["ignore"].clone()
    };
    let listed = ignore(&with);
    assert!(
        listed
            .as_array()
            .unwrap()
            .iter()
            .any(|m| m == "model.layers.3.self_attn.kv_b_proj"),
        "{listed}"
    );
    assert_eq!(ignore(&without), listed);
}

/// A shard that holds no tensor (in no index entry) is written too, empty, as the seed's
/// converter writes every `*.safetensors`; being the last, it takes the C8 scales.
#[test]
fn an_empty_shard_is_kept_and_takes_the_c8_scales() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("in");
    copy_fixture(&input);
    let empty = "model-00004-of-00004.safetensors";
    let header = b"{\"__metadata__\":{\"format\":\"pt\"}}";
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header);
    fs::write(input.join(empty), bytes).unwrap();
    let out = tmp.path().join("out");
    let mut o = opts(&input, &out);
    o.mode = QuantMode::W8A8C8;
    o.c8_scales = Some(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../fixtures/v3/converted/c8_scales_r1_tiny.json"),
    );
    convert(&o).unwrap();
    assert!(read_header(&out.join(empty)).is_ok());
    let index: serde_json::Value = serde_json::from_str(
        &fs::read_to_string(out.join("model.safetensors.index.json")).unwrap(),
    )
    .unwrap();
    let map = index["weight_map"].as_object().unwrap();
    let scales: Vec<&str> = map
        .iter()
        .filter(|(k, _)| k.ends_with("ckv_scale"))
        .map(|(_, v)| v.as_str().unwrap())
        .collect();
    assert!(
        !scales.is_empty() && scales.iter().all(|f| *f == empty),
        "{scales:?}"
    );
}
