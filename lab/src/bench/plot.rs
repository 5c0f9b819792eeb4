//! The bench's picture: latency percentiles against offered load (left), and the throughput of each
//! stage (right), as one SVG, titled with the date and the machine's size.

use std::path::Path;

use plotters::prelude::*;

use super::report::{Report, machine_line};

const WIDTH: u32 = 1200;
const HEIGHT: u32 = 480;

/// Draws what `report` has into `path`.
pub(super) fn draw(path: &Path, report: &Report) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (WIDTH, HEIGHT)).into_drawing_area();
    root.fill(&WHITE).map_err(plot_error)?;
    let title = format!(
        "waybill bench, {} profile — {} — {}",
        report.profile.name,
        chrono::Utc::now().format("%Y-%m-%d"),
        machine_line()
    );
    let root = root
        .titled(&title, ("sans-serif", 20))
        .map_err(plot_error)?;
    let (left, right) = root.split_horizontally(WIDTH / 2);
    latency(&left, report)?;
    throughput(&right, report)?;
    root.present().map_err(plot_error)?;
    Ok(())
}

fn plot_error(error: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("{error}")
}

/// Picks one percentile of a load step.
type Percentile = fn(&super::pipeline::LoadStep) -> f64;

/// p50, p95 and p99 from commit to applied in all three projections, by offered rate.
fn latency(
    area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    report: &Report,
) -> anyhow::Result<()> {
    let Some(pipeline) = &report.pipeline else {
        return Ok(());
    };
    let steps = &pipeline.sweep;
    let max_rate = steps.iter().map(|s| s.offered).max().unwrap_or(1) as f64;
    let max_ms = steps.iter().map(|s| s.p99_ms).fold(10.0_f64, f64::max) * 1.5;
    let mut chart = ChartBuilder::on(area)
        .caption(
            "commit → applied in all three projections",
            ("sans-serif", 16),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0.0..max_rate * 1.05, (1.0..max_ms).log_scale())
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc("offered events/s (orders placed over HTTP)")
        .y_desc("ms (log scale)")
        .draw()
        .map_err(plot_error)?;
    let series: [(&str, Percentile, RGBColor); 3] = [
        ("p50", |s| s.p50_ms, BLUE),
        ("p95", |s| s.p95_ms, GREEN),
        ("p99", |s| s.p99_ms, RED),
    ];
    for (name, value, color) in series {
        let points: Vec<(f64, f64)> = steps
            .iter()
            .map(|s| (s.offered as f64, value(s).max(1.0)))
            .collect();
        chart
            .draw_series(LineSeries::new(points.clone(), color.stroke_width(2)))
            .map_err(plot_error)?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
        chart
            .draw_series(points.iter().map(|p| Circle::new(*p, 3, color.filled())))
            .map_err(plot_error)?;
    }
    // Steps the pipeline did not sustain are marked with a cross on the p99 line.
    chart
        .draw_series(
            steps
                .iter()
                .filter(|s| !s.sustained)
                .map(|s| Cross::new((s.offered as f64, s.p99_ms.max(1.0)), 6, BLACK)),
        )
        .map_err(plot_error)?
        .label("not sustained")
        .legend(|(x, y)| Cross::new((x + 8, y), 5, BLACK));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(plot_error)?;
    Ok(())
}

/// Events per second each stage reaches on its own, and the whole pipeline.
fn throughput(
    area: &DrawingArea<SVGBackend, plotters::coord::Shift>,
    report: &Report,
) -> anyhow::Result<()> {
    let mut bars: Vec<(String, f64)> = Vec::new();
    if let Some(writers) = &report.writers
        && let Some((n, w)) = writers.last()
    {
        bars.push((format!("store, {n} writers"), w.store_per_s));
    }
    if let Some(r) = &report.relay {
        bars.push(("relay, one lane".into(), r.one));
        bars.push(("two relays".into(), r.two));
        bars.push(("relay, best".into(), r.best));
        bars.push(("relay, hot".into(), r.hot));
    }
    if let Some(p) = &report.projections {
        bars.push(("inventory".into(), p.inventory));
        bars.push(("points".into(), p.points));
        bars.push(("search".into(), p.search));
    }
    if let Some(p) = &report.pipeline {
        bars.push(("whole pipeline".into(), p.events_per_s as f64));
    }
    if bars.is_empty() {
        return Ok(());
    }
    let max = bars.iter().map(|b| b.1).fold(1.0_f64, f64::max) * 1.15;
    let labels: Vec<String> = bars.iter().map(|b| b.0.clone()).collect();
    let mut chart = ChartBuilder::on(area)
        .caption("throughput per stage (events/s)", ("sans-serif", 16))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(130)
        .build_cartesian_2d(0.0..max, 0.0..bars.len() as f64)
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(bars.len() * 2 + 1)
        .y_label_formatter(&|y| {
            let index = (y - 0.5).round();
            if (y - 0.5 - index).abs() < 0.01 && index >= 0.0 {
                #[allow(
                    clippy::cast_possible_truncation,
                    clippy::cast_sign_loss,
                    reason = "a whole, non-negative bar index; `as` saturates and `get` answers None past the end"
                )]
                let index = index as usize;
                labels.get(index).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .x_desc("events/s")
        .draw()
        .map_err(plot_error)?;
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, value))| {
            let y = i as f64;
            Rectangle::new(
                [(0.0, y + 0.15), (*value, y + 0.85)],
                BLUE.mix(0.6).filled(),
            )
        }))
        .map_err(plot_error)?;
    chart
        .draw_series(bars.iter().enumerate().map(|(i, (_, value))| {
            Text::new(
                format!("{value:.0}"),
                (*value + max * 0.01, i as f64 + 0.35),
                ("sans-serif", 12),
            )
        }))
        .map_err(plot_error)?;
    Ok(())
}
