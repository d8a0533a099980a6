use std::time::Instant;
fn main() {
    let threads: usize = std::env::args().nth(1).unwrap().parse().unwrap();
    spex::engine::kernels::pool::set_threads(threads).unwrap();
    for (outs, inner) in [(256usize, 256usize), (704, 256), (256, 704), (4096, 256)] {
        let w: Vec<f32> = (0..outs * inner)
            .map(|i| ((i * 7919) % 1000) as f32 / 1000.0 - 0.5)
            .collect();
        for rows in [1usize, 4] {
            let x: Vec<f32> = (0..rows * inner).map(|i| (i % 13) as f32 / 13.0).collect();
            let mut out = vec![0f32; rows * outs];
            let mut t = Vec::new();
            for _ in 0..2000 {
                let s = Instant::now();
                spex::engine::kernels::matmul_t(&x, &w, rows, inner, &mut out);
                t.push(s.elapsed());
            }
            t.sort();
            println!(
                "{outs}x{inner} rows {rows}: median {:.2} us, p10 {:.2}",
                t[1000].as_secs_f64() * 1e6,
                t[200].as_secs_f64() * 1e6
            );
        }
    }
}
