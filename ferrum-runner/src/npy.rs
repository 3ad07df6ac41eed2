//! A minimal `.npy` writer for 2-D little-endian f32 arrays (`--dump-logits`).
//!
//! Format version 1.0: magic, version, a header length, and a Python-literal header padded so
//! that the data starts on a 64-byte boundary; then the data in C order.

use std::io::Write;

/// Writes `rows × cols` f32 values (row-major) as an `.npy` array of shape `(rows, cols)`.
pub fn write_f32_2d(mut w: impl Write, rows: usize, cols: usize, data: &[f32]) -> std::io::Result<()> {
    if data.len() != rows * cols {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("npy: {} values for shape ({rows}, {cols})", data.len()),
        ));
    }
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': ({rows}, {cols}), }}");
    // 10 bytes of preamble + header + '\n' must be a multiple of 64.
    let pad = (64 - (10 + header.len() + 1) % 64) % 64;
    header.extend(std::iter::repeat_n(' ', pad));
    header.push('\n');
    w.write_all(b"\x93NUMPY\x01\x00")?;
    w.write_all(&(header.len() as u16).to_le_bytes())?;
    w.write_all(header.as_bytes())?;
    for v in data {
        w.write_all(&v.to_le_bytes())?;
    }
    w.flush()
}

#[cfg(test)]
mod tests {
    #[test]
    fn header_is_aligned_and_data_follows() {
        let mut buf = Vec::new();
        super::write_f32_2d(&mut buf, 2, 3, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]).unwrap();
        assert_eq!(&buf[..8], b"\x93NUMPY\x01\x00");
        let hlen = u16::from_le_bytes([buf[8], buf[9]]) as usize;
        assert_eq!((10 + hlen) % 64, 0);
        let header = std::str::from_utf8(&buf[10..10 + hlen]).unwrap();
        assert!(header.contains("'shape': (2, 3)") && header.ends_with('\n'));
        let data: Vec<f32> = buf[10 + hlen..].chunks(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        assert_eq!(data, [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
        assert!(super::write_f32_2d(&mut Vec::new(), 2, 2, &[1.0]).is_err());
    }
}
