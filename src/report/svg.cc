// The SVG pictures (plot.h): the timeline like memory_viz's "Active Memory Timeline" and the breakdown at the
// peak. Written here, with no plotting runtime: rectangles, paths and text at fixed places, numbers formatted
// with fixed decimals, so the same estimate gives the same bytes. Bytes are integers until they become a
// coordinate.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>

#include "text_table.h"
#include "trainmem/plot.h"

namespace trainmem {

namespace {

// Bottom of the stack to the top: what lives through the step first, then what the step makes and frees.
constexpr Category kStackOrder[] = {
    Category::kWeights,     Category::kBuffers,      Category::kOptimizer,   Category::kGradients,
    Category::kWorkspace,   Category::kKvCache,      Category::kDdpBuckets,  Category::kZeroBuckets,
    Category::kFsdpBuffers, Category::kInputs,       Category::kWeightCopies, Category::kActivations,
    Category::kBackward,    Category::kTemporaries,
};
static_assert(std::size(kStackOrder) == kCategoryCount);

// Tableau 10 and its light variants, one per category (indexed by Category).
constexpr const char* kCategoryColor[kCategoryCount] = {
    "#4e79a7",  // weights
    "#a0cbe8",  // buffers
    "#f28e2b",  // gradients
    "#59a14f",  // optimizer state
    "#b6992d",  // inputs
    "#e15759",  // activations
    "#ff9d9a",  // autocast weight copies
    "#b07aa1",  // backward gradients
    "#d4a6c8",  // temporaries
    "#9d7660",  // workspaces
    "#76b7b2",  // kv cache
    "#edc948",  // ddp buckets
    "#f1ce63",  // zero buckets
    "#86bcb6",  // fsdp buffers
};
const char* color(Category c) { return kCategoryColor[static_cast<size_t>(c)]; }

constexpr const char* kFont = "DejaVu Sans, Helvetica, Arial, sans-serif";
constexpr const char* kAllocatedColor = "#222222";
constexpr const char* kReservedColor = "#7f7f7f";
constexpr const char* kCapacityColor = "#c00000";
// A white outline under a label, so that it reads over the areas and curves.
constexpr const char* kHalo = " stroke=\"#ffffff\" stroke-width=\"3\" stroke-opacity=\"0.85\" paint-order=\"stroke\"";
constexpr double kCharWidth = 0.6;  // average advance of a character, in font sizes (DejaVu Sans is wide)

constexpr double kBoldWidth = 0.66;  // the same for bold text

// A line of text that fits `width` pixels at `char_px` a character, or its first part up to a ", " and the rest.
std::pair<std::string, std::string> split_line(const std::string& s, double width, double char_px) {
  const size_t fits = static_cast<size_t>(width / char_px);
  if (s.size() <= fits) return {s, ""};
  const size_t cut = s.rfind(", ", fits);
  if (cut == std::string::npos) return {s, ""};
  return {s.substr(0, cut + 1), s.substr(cut + 2)};
}

double text_width(std::string_view s, double font_size) { return static_cast<double>(s.size()) * kCharWidth * font_size; }

// "forward", "fwd": a band's label, long and short (none: too short to name).
std::pair<std::string, std::string> phase_words(Phase p) {
  switch (p) {
    case Phase::kSetup: return {"model load", "load"};
    case Phase::kForward: return {"forward", "fwd"};
    case Phase::kLoss: return {"loss", ""};
    case Phase::kBackward: return {"backward", "bwd"};
    case Phase::kGradClip: return {"clip_grad_norm_", ""};
    case Phase::kOptimizer: return {"optimizer step", "opt"};
    case Phase::kZeroGrad: return {"zero_grad", ""};
  }
  return {"?", ""};
}
const char* phase_color(Phase p) {
  switch (p) {
    case Phase::kSetup: return "#e8e8e8";
    case Phase::kForward: return "#dbe9f6";
    case Phase::kLoss: return "#ece2f0";
    case Phase::kBackward: return "#fde5cf";
    case Phase::kGradClip: return "#fff3c4";
    case Phase::kOptimizer: return "#dcefd5";
    case Phase::kZeroGrad: return "#eeeeee";
  }
  return "#ffffff";
}

// An axis in bytes: a "nice" tick step in a binary unit, and the top of the axis (a whole number of steps).
struct ByteAxis {
  uint64_t step = 1, top = 1;
  uint64_t unit = 1;
  const char* unit_name = "B";
};
ByteAxis byte_axis(uint64_t largest, uint64_t ticks) {
  ByteAxis a;
  largest = std::max<uint64_t>(largest, 1);
  if (largest >= 2 * kGiB) a = {1, 1, kGiB, "GiB"};
  else if (largest >= 2 * kMiB) a = {1, 1, kMiB, "MiB"};
  else if (largest >= 2 * kKiB) a = {1, 1, kKiB, "KiB"};
  // candidate steps: a quarter and a half of the unit, then 1, 2, 5 x 10^k units
  std::vector<uint64_t> steps;
  if (a.unit > 1) steps = {a.unit / 4, a.unit / 2};
  for (uint64_t p = a.unit; p <= largest; p *= 10) {
    for (uint64_t m : {1, 2, 5}) steps.push_back(m * p);
    if (p > largest / 10) break;
  }
  steps.push_back(largest);  // always one that fits
  for (uint64_t s : steps) {
    if (s > 0 && largest / s < ticks) {
      a.step = s;
      break;
    }
  }
  a.top = (largest / a.step + 1) * a.step;
  return a;
}
// "0.25 GiB", "1.5 GiB", "40 GiB"
std::string tick_label(uint64_t bytes, const ByteAxis& a) {
  std::string s = fmt::format("{:.2f}", static_cast<double>(bytes) / static_cast<double>(a.unit));
  while (s.back() == '0') s.pop_back();
  if (s.back() == '.') s.pop_back();
  return s + " " + a.unit_name;
}

// A step line through columns: y[k] over [x[k], x[k + 1]], as an SVG path ("M x0 y0 H x1 V y1 H x2 ...").
// Equal neighbours are merged, so flat stretches cost nothing.
std::string step_path(const std::vector<double>& x, const std::vector<double>& y) {
  std::string d = fmt::format("M{:.1f} {:.1f}", x[0], y[0]);
  for (size_t k = 1; k < y.size(); ++k) {
    if (fmt::format("{:.1f}", y[k]) == fmt::format("{:.1f}", y[k - 1])) continue;
    d += fmt::format("H{:.1f}V{:.1f}", x[k], y[k]);
  }
  d += fmt::format("H{:.1f}", x.back());
  return d;
}
// The area between two step lines (top left to right, then bottom right to left).
std::string step_area(const std::vector<double>& x, const std::vector<double>& top, const std::vector<double>& bottom) {
  std::string d = step_path(x, top);
  const size_t n = bottom.size();
  d += fmt::format("V{:.1f}", bottom[n - 1]);
  for (size_t k = n - 1; k > 0; --k) {
    if (fmt::format("{:.1f}", bottom[k]) == fmt::format("{:.1f}", bottom[k - 1])) continue;
    d += fmt::format("H{:.1f}V{:.1f}", x[k], bottom[k - 1]);
  }
  d += fmt::format("H{:.1f}Z", x[0]);
  return d;
}

// "model.layers.11.self_a…proj.weight": at most `n` characters, the middle left out.
std::string shortened(const std::string& s, size_t n) {
  if (s.size() <= n) return s;
  const size_t head = (n - 1) / 2, tail = n - 1 - head;
  return s.substr(0, head) + "\u2026" + s.substr(s.size() - tail);
}

// A live tensor as the legend names it: a parameter's gradient and optimizer state carry the parameter's name.
std::string tensor_words(const PlotTensor& t) {
  if (!t.of_parameter) return t.name;
  if (t.category == Category::kGradients && !t.name.ends_with(".grad")) return t.name + ".grad";
  if (t.category == Category::kOptimizer) return t.name + " (optim)";
  return t.name;
}

std::string text(double x, double y, std::string_view s, std::string_view attrs = "") {
  return fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\"{}{}>{}</text>\n", x, y, attrs.empty() ? "" : " ", attrs,
                     xml_escape(s));
}

std::string svg_open(int width, int height) {
  return fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" viewBox=\"0 0 {0} {1}\" "
      "font-family=\"{2}\" font-size=\"12\">\n<rect width=\"{0}\" height=\"{1}\" fill=\"#ffffff\"/>\n",
      width, height, kFont);
}

// What the verdict says in one line, with its colour.
std::pair<std::string, const char*> verdict_line(const Estimate& e) {
  if (!e.device) {
    return {fmt::format("no GPU given (--gpu): the caching allocator would reserve {} at most",
                        format_bytes(e.memory.peak_reserved)),
            "#444444"};
  }
  const DeviceVerdict& v = *e.device;
  if (v.fits) {
    return {fmt::format("FITS the {}: {} of headroom at the reserved peak ({} for the caching allocator of {})", v.gpu,
                        format_bytes(Bytes(static_cast<uint64_t>(v.headroom))), format_bytes(v.usable),
                        format_bytes(v.capacity)),
            "#2a7d2a"};
  }
  std::string s = fmt::format("DOES NOT FIT the {}: short by at least {}", v.gpu,
                              format_bytes(v.oom ? v.oom->short_by : Bytes{}));
  if (v.oom) s += fmt::format(" (out of memory allocating {} in {})", v.oom->tensor, moment_name(v.oom->phase, v.oom->step));
  return {s, kCapacityColor};
}

// --- the timeline ---

struct TimelineLayout {
  static constexpr int kWidth = 1300, kHeight = 700;
  static constexpr double kX0 = 84, kX1 = kX0 + kPlotColumns, kY0 = 104, kY1 = 604;
  static constexpr double kLegendX = 1004;
};

std::string timeline_strips(const TimelinePlot& p, double x_of_first, double px_per_event) {
  using L = TimelineLayout;
  std::string out = "<g id=\"phases\">\n";
  auto x_of = [&](size_t event) { return x_of_first + static_cast<double>(event - p.first_event) * px_per_event; };
  // several micro-batches a step (gradient accumulation, a pipeline's schedule): "fwd 2.3" is step 2's third
  const bool micro = std::any_of(p.phases.begin(), p.phases.end(), [](const PlotPhase& ph) { return ph.micro > 1; });
  for (const PlotPhase& ph : p.phases) {
    const double xa = x_of(ph.first_event), xb = x_of(ph.last_event + 1);
    out += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"{}\" "
                       "data-phase=\"{}\" data-step=\"{}\"><title>{}: events {} to {}</title></rect>\n",
                       xa, L::kY0, xb - xa, L::kY1 - L::kY0, phase_color(ph.phase), phase_name(ph.phase), ph.step,
                       xml_escape(moment_name(ph.phase, ph.step, micro ? ph.micro : 0)), with_commas(ph.first_event),
                       with_commas(ph.last_event));
    const auto [long_word, short_word] = phase_words(ph.phase);
    const std::string n = micro && ph.step > 0 ? fmt::format(" {}.{}", ph.step, ph.micro)
                          : ph.step > 0                         ? fmt::format(" {}", ph.step)
                                                                : std::string();
    // narrowest, a pipeline schedule's notation: F3 and B3 for micro-batch 3's forward and backward
    const std::string letter = !micro ? std::string()
                               : ph.phase == Phase::kForward  ? fmt::format("F{}", ph.micro)
                               : ph.phase == Phase::kBackward ? fmt::format("B{}", ph.micro)
                                                              : std::string();
    for (const std::string& w : {long_word + n, short_word.empty() ? short_word : short_word + n, letter}) {
      if (w.empty() || text_width(w, 10.5) + 4 > xb - xa) continue;
      out += text((xa + xb) / 2, L::kY0 - 6, w, "font-size=\"10.5\" text-anchor=\"middle\" fill=\"#333333\"");
      break;
    }
  }
  // the steps above the phases: "model load", "step 1", ...
  for (size_t i = 0; i < p.phases.size();) {
    size_t j = i;
    while (j + 1 < p.phases.size() && p.phases[j + 1].step == p.phases[i].step) ++j;
    const double xa = x_of(p.phases[i].first_event), xb = x_of(p.phases[j].last_event + 1);
    const std::string w = p.phases[i].step == 0 ? "setup" : fmt::format("step {}", p.phases[i].step);
    if (i > 0) {
      out += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"#999999\" "
                         "stroke-dasharray=\"3 3\"/>\n", xa, L::kY0 - 34, L::kY1);
    }
    if (text_width(w, 11) + 4 <= xb - xa) out += text((xa + xb) / 2, L::kY0 - 22, w, "font-weight=\"bold\" text-anchor=\"middle\" fill=\"#333333\"");
    i = j + 1;
  }
  return out + "</g>\n";
}

std::string timeline_axes(const TimelinePlot& p, const ByteAxis& ya, double px_per_event) {
  using L = TimelineLayout;
  std::string out = "<g id=\"y-axis\" font-size=\"11\" fill=\"#333333\">\n";
  for (uint64_t b = 0; b <= ya.top; b += ya.step) {
    const double y = L::kY1 - static_cast<double>(b) / static_cast<double>(ya.top) * (L::kY1 - L::kY0);
    out += fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#000000\" "
                       "stroke-opacity=\"0.12\" data-bytes=\"{}\"/>\n", L::kX0 - 4, y, L::kX1, y, b);
    out += text(L::kX0 - 7, y + 4, tick_label(b, ya), "text-anchor=\"end\"");
  }
  out += "</g>\n<g id=\"x-axis\" font-size=\"11\" fill=\"#333333\">\n";
  const uint64_t n = p.last_event - p.first_event + 1;
  uint64_t step = 1;
  for (uint64_t m = 1;; m *= 10) {
    if (n / m < 10) { step = m; break; }
    if (n / (2 * m) < 10) { step = 2 * m; break; }
    if (n / (5 * m) < 10) { step = 5 * m; break; }
  }
  for (uint64_t ev = (p.first_event + step - 1) / step * step; ev <= p.last_event + 1; ev += step) {
    const double x = L::kX0 + static_cast<double>(ev - p.first_event) * px_per_event;
    out += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"#333333\"/>\n", x,
                       L::kY1, L::kY1 + 4);
    out += text(x, L::kY1 + 17, with_commas(ev), "text-anchor=\"middle\"");
  }
  out += text((L::kX0 + L::kX1) / 2, L::kY1 + 38,
              "event (every allocation, free and change of category of the simulated step, in order)",
              "text-anchor=\"middle\"");
  out += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.1f}\" height=\"{:.1f}\" fill=\"none\" "
                     "stroke=\"#333333\"/>\n", L::kX0, L::kY0, L::kX1 - L::kX0, L::kY1 - L::kY0);
  return out + "</g>\n";
}

std::string timeline_legend(const Estimate& e, const TimelinePlot& p) {
  using L = TimelineLayout;
  const double x = L::kLegendX, right = TimelineLayout::kWidth - 12;
  double y = L::kY0 + 4;
  std::string out = "<g id=\"legend\">\n";
  out += text(x, y, "live tensors at the peak", "font-weight=\"bold\"");
  y += 8;
  for (size_t k = kCategoryCount; k-- > 0;) {  // the top of the stack first, as drawn
    const Category c = kStackOrder[k];
    if (p.category_peak[static_cast<size_t>(c)].value == 0) continue;
    y += 17;
    out += fmt::format("<g data-category=\"{}\">", category_name(c));
    out += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"12\" height=\"12\" fill=\"{}\"/>", x, y - 10, color(c));
    out += text(x + 18, y, category_name(c));
    out += text(right, y, format_bytes(p.peak.live.by_category[static_cast<size_t>(c)]), "text-anchor=\"end\"");
    out += "</g>\n";
  }
  y += 17;
  out += fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"#999999\"/>\n", x, y - 11,
                     right, y - 11);
  out += text(x + 18, y + 2, "total");
  out += text(right, y + 2, format_bytes(p.peak.live.total), "text-anchor=\"end\" font-weight=\"bold\"");
  y += 10;
  auto line_key = [&](const char* stroke, const char* dash, const std::string& name, const std::string& value) {
    y += 17;
    out += fmt::format("<line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" y2=\"{:.1f}\" stroke=\"{}\" stroke-width=\"2\"{}/>",
                       x, y - 4, x + 12, y - 4, stroke, dash);
    out += text(x + 18, y, name);
    out += text(right, y, value, "text-anchor=\"end\"");
  };
  line_key(kAllocatedColor, "", "allocated (peak)", format_bytes(Bytes(p.max_allocated)));
  line_key(kReservedColor, "", "reserved (peak)", format_bytes(Bytes(p.max_reserved)));
  if (e.device) line_key(kCapacityColor, " stroke-dasharray=\"6 4\"", e.device->gpu + " capacity", format_bytes(e.device->capacity));
  y += 30;
  out += "</g>\n<g id=\"peak-tensors\" font-size=\"10.5\">\n";
  out += text(x, y, "largest tensors live at the peak", "font-weight=\"bold\" font-size=\"12\"");
  y += 4;
  for (const PlotTensor& t : p.peak_tensors) {
    y += 15;
    out += fmt::format("<g data-bytes=\"{}\"><title>{} ({}, {} bytes)</title>", t.bytes.value, xml_escape(t.name),
                       category_name(t.category), with_commas(t.bytes.value));
    out += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"8\" height=\"8\" fill=\"{}\"/>", x, y - 7, color(t.category));
    out += text(x + 74, y, format_bytes(t.bytes), "text-anchor=\"end\"");
    out += text(x + 80, y, shortened(tensor_words(t), 32));
    out += "</g>\n";
  }
  return out + "</g>\n";
}

}  // namespace

std::string xml_escape(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char ch : s) {
    switch (ch) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&quot;"; break;
      case '\'': out += "&apos;"; break;
      default: out += ch;
    }
  }
  return out;
}

namespace {

// Where the timeline's bytes and events go on the page.
struct TimelineFrame {
  using L = TimelineLayout;
  ByteAxis ya;
  std::vector<double> x;  // the columns' edges
  double px_per_event = 1;
  double y_of(uint64_t b) const {
    return L::kY1 - static_cast<double>(b) / static_cast<double>(ya.top) * (L::kY1 - L::kY0);
  }
  double x_of_event(size_t ev, size_t first) const {  // the middle of the event's share of the width
    return L::kX0 + (static_cast<double>(ev - first) + 0.5) * px_per_event;
  }
};

// The stacked areas (live bytes by category at each column's fullest moment), then the allocator's curves.
std::string timeline_areas(const TimelinePlot& p, const TimelineFrame& f) {
  const size_t c = p.columns.size();
  std::string out = fmt::format("<g id=\"areas\" data-bytes-top=\"{}\">\n", f.ya.top);
  std::vector<uint64_t> below(c, 0);
  std::vector<double> bottom(c), top(c);
  for (Category cat : kStackOrder) {
    if (p.category_peak[static_cast<size_t>(cat)].value == 0) continue;
    for (size_t k = 0; k < c; ++k) {
      bottom[k] = f.y_of(below[k]);
      below[k] += p.columns[k].live.by_category[static_cast<size_t>(cat)].value;
      top[k] = f.y_of(below[k]);
    }
    out += fmt::format("<path class=\"area\" data-category=\"{}\" fill=\"{}\" d=\"{}\"><title>{}: at most {}</title>"
                       "</path>\n", category_name(cat), color(cat), step_area(f.x, top, bottom), category_name(cat),
                       format_bytes(p.category_peak[static_cast<size_t>(cat)]));
  }
  out += "</g>\n";
  std::vector<double> allocated(c), reserved(c);
  for (size_t k = 0; k < c; ++k) {
    allocated[k] = f.y_of(p.columns[k].allocated);
    reserved[k] = f.y_of(p.columns[k].reserved);
  }
  out += fmt::format("<path id=\"reserved\" fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" d=\"{}\"/>\n",
                     kReservedColor, step_path(f.x, reserved));
  out += fmt::format("<path id=\"allocated\" fill=\"none\" stroke=\"{}\" stroke-width=\"1\" d=\"{}\"/>\n",
                     kAllocatedColor, step_path(f.x, allocated));
  return out;
}

// --gpu: the card's capacity, and the first allocation that would fail there.
std::string timeline_device(const Estimate& e, const TimelinePlot& p, const TimelineFrame& f) {
  using L = TimelineLayout;
  const DeviceVerdict& v = *e.device;
  const double y = f.y_of(v.capacity.value);
  std::string out = fmt::format("<g id=\"capacity\" data-bytes=\"{}\"><line x1=\"{:.1f}\" y1=\"{:.1f}\" x2=\"{:.1f}\" "
                                "y2=\"{:.1f}\" stroke=\"{}\" stroke-width=\"1.5\" stroke-dasharray=\"6 4\"/>",
                                v.capacity.value, L::kX0, y, L::kX1, y, kCapacityColor);
  out += text(L::kX1 - 4, y + 14, fmt::format("{}: {} ({} for the caching allocator)", v.gpu, format_bytes(v.capacity),
                                              format_bytes(v.usable)),
              fmt::format("text-anchor=\"end\" font-size=\"11\" fill=\"{}\"{}", kCapacityColor, kHalo));
  out += "</g>\n";
  if (const auto& oom = v.oom; oom && oom->event >= p.first_event && oom->event <= p.last_event) {
    const double xo = f.x_of_event(oom->event, p.first_event);
    const bool left = xo > (L::kX0 + L::kX1) / 2;
    out += fmt::format("<g id=\"oom\"><line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"{3}\" "
                       "stroke-width=\"2\"/>", xo, L::kY0, L::kY1, kCapacityColor);
    out += text(xo + (left ? -5 : 5), L::kY0 + 14, fmt::format("out of memory: {} ({})", oom->tensor, format_bytes(oom->requested)),
                fmt::format("font-size=\"11\" font-weight=\"bold\" fill=\"{}\" text-anchor=\"{}\"{}", kCapacityColor,
                            left ? "end" : "start", kHalo));
    out += "</g>\n";
  }
  return out;
}

// The peak: its column's top, with the figure.
std::string timeline_peak(const TimelinePlot& p, const TimelineFrame& f) {
  using L = TimelineLayout;
  const double xp = (f.x[p.peak_column] + f.x[p.peak_column + 1]) / 2, yp = f.y_of(p.peak.live.total.value);
  const bool left = xp > (L::kX0 + L::kX1) / 2;
  std::string out = fmt::format("<g id=\"peak\" data-bytes=\"{}\" data-event=\"{}\" data-column=\"{}\">",
                                p.peak.live.total.value, p.peak.event, p.peak_column);
  out += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"#000000\" "
                     "stroke-dasharray=\"2 2\"/>", xp, yp, L::kY1);
  out += fmt::format("<circle cx=\"{:.1f}\" cy=\"{:.1f}\" r=\"4\" fill=\"#000000\"/>", xp, yp);
  out += text(xp + (left ? -8 : 8), yp - 6, "peak " + format_bytes(p.peak.live.total),
              fmt::format("font-weight=\"bold\" text-anchor=\"{}\"{}", left ? "end" : "start", kHalo));
  return out + "</g>\n";
}

}  // namespace

std::string render_timeline_svg(const Estimate& e, const TimelinePlot& p) {
  using L = TimelineLayout;
  const size_t c = p.columns.size();
  const uint64_t capacity = e.device ? e.device->capacity.value : 0;
  TimelineFrame f;
  f.ya = byte_axis(std::max({p.max_reserved, p.peak.live.total.value, capacity}), 8);
  f.x.resize(c + 1);
  for (size_t k = 0; k <= c; ++k) f.x[k] = L::kX0 + static_cast<double>(k) * (L::kX1 - L::kX0) / static_cast<double>(c);
  f.px_per_event = (L::kX1 - L::kX0) / static_cast<double>(p.last_event - p.first_event + 1);

  std::string out = svg_open(L::kWidth, L::kHeight);
  const auto [title1, title2] = split_line(p.title, L::kWidth - L::kX0 - 16, 16 * kBoldWidth);
  out += text(L::kX0, 26, title1, "font-size=\"16\" font-weight=\"bold\"");
  if (!title2.empty()) out += text(L::kX0, 45, title2, "font-size=\"16\" font-weight=\"bold\"");
  out += text(L::kX0, title2.empty() ? 47 : 64, p.subtitle, "font-size=\"12.5\" fill=\"#444444\"");
  if (e.setup.grad_accum > 2) {  // as the table says it
    out += text(L::kX0, L::kY1 + 58,
                fmt::format("micro-batches 1 and 2 of each step's {} are simulated; the others repeat micro-batch 2",
                            e.setup.grad_accum),
                "font-size=\"11\" fill=\"#444444\"");
  }
  out += timeline_strips(p, L::kX0, f.px_per_event);
  out += timeline_axes(p, f.ya, f.px_per_event);
  out += timeline_areas(p, f);
  if (e.device) out += timeline_device(e, p, f);
  out += timeline_peak(p, f);
  out += timeline_legend(e, p);
  return out + "</svg>\n";
}

std::string render_timeline_html(const Estimate& e, const TimelinePlot& p, std::string_view table) {
  std::string out = fmt::format(
      "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>trainmem timeline: {}</title>\n"
      "<style>\nbody {{ font-family: {}; margin: 24px; color: #222222; }}\n"
      "svg {{ max-width: 100%; height: auto; }}\npre {{ font-size: 12px; overflow-x: auto; }}\n</style>\n"
      "</head>\n<body>\n",
      xml_escape(p.title), kFont);
  out += render_timeline_svg(e, p);
  out += "<pre>\n" + xml_escape(table) + "</pre>\n</body>\n</html>\n";
  return out;
}

// --- the breakdown ---

namespace {

// Where the breakdown's bytes go on the page: one bar, its axis above, its marks' key under it, then the rows.
struct BreakdownFrame {
  static constexpr int kWidth = 1000;
  static constexpr double kX0 = 40, kX1 = kWidth - 40, kBarY = 92, kBarH = 34, kRowsY = kBarY + kBarH + 66;
  ByteAxis xa;
  double x_of(uint64_t b) const { return kX0 + static_cast<double>(b) / static_cast<double>(xa.top) * (kX1 - kX0); }
};

// The bar of the live tensors at the peak by category, with its axis above.
std::string breakdown_bar(const Estimate& e, const std::vector<Category>& shown, const BreakdownFrame& f) {
  using F = BreakdownFrame;
  std::string out = "<g id=\"axis\" font-size=\"10.5\" fill=\"#333333\">\n";
  for (uint64_t b = 0; b <= f.xa.top; b += f.xa.step) {
    out += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"#000000\" "
                       "stroke-opacity=\"0.15\" data-bytes=\"{3}\"/>", f.x_of(b), F::kBarY - 8, F::kBarY + F::kBarH + 4, b);
    out += text(f.x_of(b), F::kBarY - 12, tick_label(b, f.xa), "text-anchor=\"middle\"");
  }
  out += "</g>\n<g id=\"bar\">\n";
  uint64_t at = 0;
  for (Category c : shown) {
    const uint64_t b = e.sim->peak.live.by_category[static_cast<size_t>(c)].value;
    out += fmt::format("<rect data-category=\"{}\" data-bytes=\"{}\" x=\"{:.2f}\" y=\"{:.1f}\" width=\"{:.2f}\" "
                       "height=\"{:.1f}\" fill=\"{}\"/>\n", category_name(c), b, f.x_of(at), F::kBarY,
                       f.x_of(at + b) - f.x_of(at), F::kBarH, color(c));
    at += b;
  }
  return out + "</g>\n";
}

// Allocated, reserved and the card: lines across the bar, named in a key under it.
std::string breakdown_marks(const Estimate& e, const BreakdownFrame& f) {
  using F = BreakdownFrame;
  struct Mark {
    const char* id;
    uint64_t bytes;
    std::string label;
    const char* stroke;
    const char* dash;
  };
  std::vector<Mark> marks = {
      {"allocated", e.memory.peak_allocated.value, "peak allocated " + format_bytes(e.memory.peak_allocated),
       kAllocatedColor, ""},
      {"reserved", e.memory.peak_reserved.value, "peak reserved " + format_bytes(e.memory.peak_reserved),
       kReservedColor, ""}};
  if (e.device) {
    marks.push_back({"capacity", e.device->capacity.value,
                     fmt::format("{} capacity {}", e.device->gpu, format_bytes(e.device->capacity)), kCapacityColor,
                     " stroke-dasharray=\"5 3\""});
  }
  std::string out = "<g id=\"marks\" font-size=\"11\">\n";
  double xk = F::kX0;
  const double yk = F::kBarY + F::kBarH + 26;
  for (const Mark& m : marks) {
    const double xm = f.x_of(m.bytes);
    out += fmt::format("<g id=\"{}\" data-bytes=\"{}\"><line x1=\"{:.2f}\" y1=\"{:.1f}\" x2=\"{:.2f}\" y2=\"{:.1f}\" "
                       "stroke=\"{}\" stroke-width=\"2\"{}/>", m.id, m.bytes, xm, F::kBarY - 5, xm, F::kBarY + F::kBarH + 5,
                       m.stroke, m.dash);
    out += fmt::format("<line x1=\"{0:.1f}\" y1=\"{1:.1f}\" x2=\"{0:.1f}\" y2=\"{2:.1f}\" stroke=\"{3}\" "
                       "stroke-width=\"2\"{4}/>", xk + 3, yk - 11, yk + 2, m.stroke, m.dash);
    out += text(xk + 10, yk, m.label, fmt::format("fill=\"{}\"", m.stroke));
    out += "</g>\n";
    xk += 10 + text_width(m.label, 11) + 24;
  }
  return out + "</g>\n";
}

// One row a category, in the bar's order: its bytes as a bar scaled to the largest, and its share.
std::string breakdown_rows(const Estimate& e, const std::vector<Category>& shown) {
  using F = BreakdownFrame;
  constexpr double kLongest = 520;  // pixels of the largest category's bar
  const auto& by_cat = e.sim->peak.live.by_category;
  uint64_t largest = 1;
  for (Category c : shown) largest = std::max(largest, by_cat[static_cast<size_t>(c)].value);
  std::string out = "<g id=\"components\">\n";
  double y = F::kRowsY;
  for (Category c : shown) {
    const uint64_t b = by_cat[static_cast<size_t>(c)].value;
    const double w = static_cast<double>(b) / static_cast<double>(largest) * kLongest;
    out += fmt::format("<g data-category=\"{}\" data-bytes=\"{}\">", category_name(c), b);
    out += text(F::kX0 + 180, y, category_name(c), "text-anchor=\"end\"");
    out += fmt::format("<rect x=\"{:.1f}\" y=\"{:.1f}\" width=\"{:.2f}\" height=\"14\" fill=\"{}\"/>", F::kX0 + 190,
                       y - 11, w, color(c));
    out += text(F::kX0 + 196 + w, y,
                fmt::format("{}  {}", format_bytes(Bytes(b)), report::percent(b, e.peak.live_total.value)));
    out += "</g>\n";
    y += 24;
  }
  return out + "</g>\n";
}

}  // namespace

std::string render_breakdown_svg(const Estimate& e) {
  using F = BreakdownFrame;
  std::vector<Category> shown;
  for (Category c : kStackOrder) {
    if (e.sim->peak.live.by_category[static_cast<size_t>(c)].value > 0) shown.push_back(c);
  }
  const double verdict_y = F::kRowsY + 24.0 * static_cast<double>(shown.size()) + 16;
  BreakdownFrame f;
  const uint64_t capacity = e.device ? e.device->capacity.value : 0;
  f.xa = byte_axis(std::max({e.memory.peak_reserved.value, e.peak.live_total.value, capacity}), 10);

  std::string out = svg_open(F::kWidth, static_cast<int>(verdict_y + 40));
  out += text(F::kX0, 26, fmt::format("{}: batch {} x seq {}, {}, {}", e.model.name, e.setup.batch, e.setup.seq,
                                      precision_name(e.setup.precision), step_label(e.setup)),
              "font-size=\"15\" font-weight=\"bold\"");
  out += text(F::kX0, 46, fmt::format("live tensors at the peak, in {}: {}", moment_name(e.peak.phase, e.peak.step),
                                      format_bytes(e.peak.live_total)),
              "font-size=\"12.5\" fill=\"#444444\"");
  out += breakdown_bar(e, shown, f);
  out += breakdown_marks(e, f);
  out += breakdown_rows(e, shown);
  const auto [verdict, verdict_color] = verdict_line(e);
  out += text(F::kX0, verdict_y, verdict, fmt::format("id=\"verdict\" font-weight=\"bold\" fill=\"{}\"", verdict_color));
  return out + "</svg>\n";
}

}  // namespace trainmem
