// Memoized pipeline actions (memo.h has the argument; this file the records and the replays).
#include "memo.h"

#include <algorithm>

#include "trainmem/error.h"

namespace trainmem::sim {

namespace {
constexpr uint8_t kRole0 = 3;  // Pair::saved: a role's index + kRole0

// The key's first words: the action's static position (MemoAction)
std::vector<uint64_t> static_words(const MemoAction& a) {
  return {a.stage, a.forward ? 1u : 0u, a.first_forward ? 1u : 0u, a.first_backward ? 1u : 0u, a.last_backward ? 1u : 0u,
          a.previous_forward_stage};
}
constexpr size_t kStaticWords = 6;

bool same_static(const std::vector<uint64_t>& a, const std::vector<uint64_t>& b) {
  return a.size() >= kStaticWords && b.size() >= kStaticWords && std::equal(a.begin(), a.begin() + kStaticWords, b.begin());
}
}  // namespace

ActionMemo::ActionMemo(Engine& e, uint64_t fixed_below, std::function<MemoProbe(uint64_t)> probe)
    : e_(e), fixed_below_(fixed_below), probe_(std::move(probe)) {}

std::vector<uint64_t> ActionMemo::key_of(const MemoAction& a, const MemoProbe& p) const {
  std::vector<uint64_t> k = static_words(a);
  k.push_back(e_.at_rest() ? 1 : 0);
  k.push_back(p.words.size());
  k.insert(k.end(), p.words.begin(), p.words.end());
  // the stage's own FSDP2 root (the hooks its program and its graph run; every other root must stay as it is)
  if (a.stage < p.roots.size()) p.roots[a.stage]->memo_key(k, !a.forward);
  return k;
}

bool ActionMemo::fixed(uint64_t id) const {
  return id < fixed_below_ && !std::binary_search(all_roles_.begin(), all_roles_.end(), id);
}

void ActionMemo::begin(const MemoAction& a, const std::vector<uint64_t>& roles, const MemoAction* backward) {
  recording_ = false;
  if (a.forward) {
    if (!backward) return;
    before_ = probe_(a.stage);
    std::vector<uint64_t> key = key_of(a, before_);
    b_static_ = static_words(*backward);
    // one template a (forward key, backward position) is enough: none when a pair or a recorded forward has it
    for (const Pair& p : pairs_) {
      if (p.f.key == key && same_static(p.b.key, b_static_)) return;
    }
    for (const auto& [where, p] : pending_) {
      if (p.ok && p.f.key == key && p.b_static == b_static_) return;
    }
    cur_ = Segment{};
    cur_.key = std::move(key);
  } else {
    // the backward of a recorded forward
    auto it = pending_.find({a.stage, a.micro});
    if (it == pending_.end()) return;
    if (!it->second.ok) {
      pending_.erase(it);
      return;
    }
    // rule 3: the forward's storages live at its end are untouched until its backward begins
    for (const auto& [id, cat] : it->second.live) {
      const StorageInfo& s = e_.storage_at(id);
      if (s.refs == 0 || s.resized_out || s.category != cat) {
        pending_.erase(it);
        return;
      }
    }
    before_ = probe_(a.stage);
    cur_ = Segment{};
    cur_.key = key_of(a, before_);
    cur_.f_st0 = it->second.f.st0;
    cur_.f_st1 = it->second.f.st1;
  }
  recording_ = true;
  cur_.st0 = e_.storage_count();
  cur_.seq = e_.node_seq();
  cur_.ev0 = e_.event_count();
  snaps_.clear();
  for (const Fsdp2* r : before_.roots) snaps_.push_back(r->memo_snapshot());
  lists0_.clear();
  for (const std::vector<T>* l : before_.lists) {
    std::vector<uint64_t>& ids = lists0_.emplace_back();
    for (const T& t : *l) ids.push_back(t ? t->storage : UINT64_MAX);
  }
  roles_ = roles;
  rest0_ = e_.at_rest();
  tape_.clear();
  e_.count_tape = &tape_;
}

void ActionMemo::end(const MemoAction& a) {
  if (!recording_) return;
  recording_ = false;
  e_.count_tape = nullptr;
  Segment& s = cur_;
  s.counts = tape_;
  s.st1 = e_.storage_count();
  s.ev1 = e_.event_count();
  s.seq = e_.node_seq() - s.seq;
  const MemoProbe after = probe_(a.stage);
  s.ok = e_.at_rest() && rest0_ && after.persistent == before_.persistent && after.roots == before_.roots;
  // FSDP2: the stage's root changed by a delta (memo_delta), every other root not at all
  for (size_t r = 0; s.ok && r < after.roots.size(); ++r) {
    const Fsdp2::MemoSnapshot now = after.roots[r]->memo_snapshot();
    if (r != a.stage) {
      s.ok = now == snaps_[r];
      continue;
    }
    std::optional<Fsdp2::MemoDelta> d = Fsdp2::memo_delta(snaps_[r], now);
    if (!d) {
      s.ok = false;
    } else {
      s.fsdp.push_back(std::move(*d));
    }
  }
  // rule 2: every storage an event names is the action's own, its forward's (a backward), or fixed
  std::vector<uint64_t> touched_fixed;
  for (size_t i = s.ev0; s.ok && i < s.ev1; ++i) {
    const Event& ev = e_.event_at(i);
    const uint64_t id = ev.storage;
    if (ev.kind == Event::kEmptyCache || id >= s.st0 || (id >= s.f_st0 && id < s.f_st1)) continue;
    if (!fixed(id)) s.ok = false;
    touched_fixed.push_back(id);
  }
  // rule 3's escapes: the lists keep what they had and may have handles appended, each on a storage of the
  // action's own or (a backward) of its forward's
  for (size_t r = 0; s.ok && r < after.lists.size(); ++r) {
    const std::vector<T>& l = *after.lists[r];
    const std::vector<uint64_t>& was = lists0_[r];
    if (l.size() < was.size()) {
      s.ok = false;
      break;
    }
    for (size_t i = 0; s.ok && i < l.size(); ++i) {
      const uint64_t id = l[i] ? l[i]->storage : UINT64_MAX;
      if (i < was.size()) {
        s.ok = id == was[i];
        continue;
      }
      Segment::Escape x;
      x.list = static_cast<uint8_t>(r);
      x.pos = i;
      if (!l[i]) {
        s.ok = false;
        break;
      }
      if (id >= s.st0 && id < s.st1) {
        x.kind = kInside;
        x.off = id - s.st0;
      } else if (id >= s.f_st0 && id < s.f_st1) {
        x.kind = kForward;
        x.off = id - s.f_st0;
      } else {
        s.ok = false;
        break;
      }
      x.like = *l[i].get();
      x.like.grad_fn = GradEdge{};
      x.like.eng = nullptr;
      x.like.refs = 0;
      x.refs = e_.storage_at(id).refs;
      s.escapes.push_back(x);
    }
  }
  if (s.ok) {
    std::sort(touched_fixed.begin(), touched_fixed.end());
    touched_fixed.erase(std::unique(touched_fixed.begin(), touched_fixed.end()), touched_fixed.end());
    for (uint64_t id : touched_fixed) s.fixed_final.emplace_back(id, e_.storage_at(id));
  }
  if (a.forward) {
    Pending p;
    p.ok = s.ok;
    p.b_static = b_static_;
    if (p.ok) {
      for (uint64_t id = s.st0; id < s.st1; ++id) s.inside_final.push_back(e_.storage_at(id));
      // the graph's kept and saved storages, each the forward's own, a role's, or fixed (rule 2)
      std::array<std::vector<uint64_t>, 2> ids;
      e_.kept_ids(a.graph, ids[0], ids[1]);
      for (size_t k = 0; k < 2; ++k) {
        for (uint64_t id : ids[k]) {
          if (id >= s.st0 && id < s.st1) {
            p.saved[k].emplace_back(kInside, id - s.st0);
            continue;
          }
          const auto r = std::find(roles_.begin(), roles_.end(), id);
          if (r != roles_.end()) {
            p.saved[k].emplace_back(static_cast<uint8_t>(kRole0 + (r - roles_.begin())), 0);
          } else if (fixed(id)) {
            p.saved[k].emplace_back(kFixed, id);
          } else {
            p.ok = false;
          }
        }
      }
      for (uint64_t id = s.st0; id < s.st1; ++id) {
        const StorageInfo& si = e_.storage_at(id);
        if (si.refs > 0 && !si.resized_out) p.live.emplace_back(id, si.category);
      }
    }
    if (p.ok) {
      p.f = std::move(s);
      p.serial = serials_++;
      pending_[{a.stage, a.micro}] = std::move(p);
    }
    return;
  }
  auto it = pending_.find({a.stage, a.micro});
  if (it == pending_.end()) return;
  Pending& pend = it->second;
  // rule 3: what the forward and the backward allocated is freed by the backward's end, but for the escapes,
  // which the lists alone hold (each escape's impl the list's alone, the storage's references the escapes')
  bool ok = s.ok;
  std::vector<uint64_t> escaped;
  for (const Segment* g : {&pend.f, &s}) {
    for (const Segment::Escape& x : g->escapes) {
      escaped.push_back((x.kind == kInside ? g->st0 : pend.f.st0) + x.off);
      const std::vector<T>& l = *after.lists[x.list];
      ok = ok && x.pos < l.size() && l[x.pos] && l[x.pos]->refs == 1;
    }
  }
  auto held = [&](uint64_t id) {
    const auto n = static_cast<uint32_t>(std::count(escaped.begin(), escaped.end(), id));
    return e_.storage_at(id).refs == n;
  };
  for (uint64_t id = pend.f.st0; ok && id < pend.f.st1; ++id) ok = held(id);
  for (uint64_t id = s.st0; ok && id < s.st1; ++id) ok = held(id);
  if (ok) {
    Pair pair{std::move(pend.f), std::move(s), std::move(pend.saved), {}};
    std::sort(escaped.begin(), escaped.end());
    escaped.erase(std::unique(escaped.begin(), escaped.end()), escaped.end());
    for (uint64_t id : escaped) pair.escaped_final.emplace_back(id, e_.storage_at(id));
    completed_[pend.serial] = pairs_.size();
    pairs_.push_back(std::move(pair));
  }
  pending_.erase(it);
}

void ActionMemo::escape(const Segment& s, const MemoProbe& p, uint64_t inside0, uint64_t forward0) {
  for (const Segment::Escape& x : s.escapes) {
    const uint64_t id = (x.kind == kInside ? inside0 : forward0) + x.off;
    p.lists[x.list]->push_back(e_.adopt(id, x.like));
    e_.storage_at(id).refs = x.refs;  // the template's count at the action's end
  }
}

void ActionMemo::emit(const Segment& s, uint64_t inside0, uint64_t forward0) {
  for (size_t i = s.ev0; i < s.ev1; ++i) {
    Event ev = e_.event_at(i);  // a copy: replay_event appends to the same timeline
    const uint64_t id = ev.storage;
    if (ev.kind != Event::kEmptyCache) {
      if (id >= s.st0) {
        ev.storage = static_cast<uint32_t>(inside0 + (id - s.st0));
      } else if (id >= s.f_st0 && id < s.f_st1) {
        ev.storage = static_cast<uint32_t>(forward0 + (id - s.f_st0));
      }
    }
    ev.step = e_.step;
    ev.micro = e_.micro;
    if (!e_.replay_event(ev)) throw MemoMismatch{};  // past 2^64 live bytes: the full simulation says so
  }
}

namespace {
void apply_segment_state(Engine& e, const std::vector<Engine::CountCall>& counts, uint64_t seq,
                         const std::vector<std::pair<uint64_t, StorageInfo>>& fixed_final) {
  for (const auto& [id, info] : fixed_final) {
    StorageInfo& s = e.storage_at(id);
    s.category = info.category;
    s.resized_out = info.resized_out;
    s.stream = info.stream;
    s.label = info.label;
  }
  e.advance_node_seq(seq);
  for (const Engine::CountCall& c : counts) e.replay_count(c);
}
}  // namespace

bool ActionMemo::replay_forward(const MemoAction& a, const MemoAction& backward, const std::vector<uint64_t>& roles) {
  if (pairs_.empty() && pending_.empty()) return false;
  const MemoProbe p = probe_(a.stage);
  const std::vector<uint64_t> key = key_of(a, p);
  const std::vector<uint64_t> bstatic = static_words(backward);
  Phantom ph;
  const Segment* f = nullptr;
  const std::array<std::vector<std::pair<uint8_t, uint64_t>>, 2>* saved = nullptr;
  for (size_t i = pairs_.size(); i-- > 0;) {
    if (pairs_[i].f.key == key && same_static(pairs_[i].b.key, bstatic)) {
      ph.pair = i;
      f = &pairs_[i].f;
      saved = &pairs_[i].saved;
      break;
    }
  }
  // else a recorded forward whose backward has not run yet (a pipeline's warm-up: 1F1B's first stage runs
  // micro-batches 1 to pp-1 before its first backward); rule 4 holds this micro-batch's backward to the pair it
  // becomes
  for (auto it = pending_.begin(); !f && it != pending_.end(); ++it) {
    const Pending& pend = it->second;
    if (pend.ok && pend.f.key == key && pend.b_static == bstatic) {
      ph.from_pending = true;
      ph.serial = pend.serial;
      f = &pend.f;
      saved = &pend.saved;
    }
  }
  if (!f) return false;
  // the roles the graph keeps exist for this micro-batch
  for (const auto& list : *saved) {
    for (const auto& [kind, v] : list) {
      if (kind >= kRole0 && (static_cast<size_t>(kind - kRole0) >= roles.size() || roles[kind - kRole0] == UINT64_MAX)) {
        return false;
      }
    }
  }
  const uint64_t st = e_.storage_count();
  emit(*f, st, 0);
  for (const StorageInfo& s : f->inside_final) e_.push_storage(s);
  escape(*f, p, st, 0);
  apply_segment_state(e_, f->counts, f->seq, f->fixed_final);
  if (!f->fsdp.empty()) p.roots[a.stage]->memo_apply(f->fsdp.front());
  Engine::PhantomGraph g;
  g.graph = a.graph;
  for (size_t k = 0; k < 2; ++k) {
    std::vector<uint64_t>& ids = k == 0 ? g.kept : g.saved;
    for (const auto& [kind, v] : (*saved)[k]) ids.push_back(kind == kInside ? st + v : kind == kFixed ? v : roles[kind - kRole0]);
  }
  e_.phantoms.push_back(std::move(g));
  ph.st0 = st;
  ph.graph = a.graph;
  phantoms_[{a.stage, a.micro}] = ph;
  ++replayed_;
  return true;
}

bool ActionMemo::replay_backward(const MemoAction& a) {
  auto it = phantoms_.find({a.stage, a.micro});
  if (it == phantoms_.end()) return false;
  Phantom ph = it->second;
  if (ph.from_pending) {
    // the template's backward has run by now and made it a pair, or the whole simulation again (rule 4)
    const auto done = completed_.find(ph.serial);
    if (done == completed_.end()) throw MemoMismatch{};
    ph.pair = done->second;
  }
  const Pair& pair = pairs_[ph.pair];
  const MemoProbe p = probe_(a.stage);
  if (key_of(a, p) != pair.b.key) throw MemoMismatch{};  // rule 4: the whole simulation again, every action run
  const uint64_t st = e_.storage_count();
  emit(pair.b, st, ph.st0);
  // the table's entries of the template's ranges after its backward (freed storages are not touched again; the
  // escapes' references are set by escape())
  for (uint64_t id = pair.b.st0; id < pair.b.st1; ++id) {
    const StorageInfo info = e_.storage_at(id);  // a copy: the table grows
    e_.push_storage(info);
  }
  for (uint64_t id = pair.f.st0; id < pair.f.st1; ++id) e_.storage_at(ph.st0 + (id - pair.f.st0)) = e_.storage_at(id);
  // the escapes' entries as they were at the template's backward's end (a list that held one has dropped it since)
  for (const auto& [id, info] : pair.escaped_final) {
    e_.storage_at(id >= pair.b.st0 ? st + (id - pair.b.st0) : ph.st0 + (id - pair.f.st0)) = info;
  }
  escape(pair.b, p, st, ph.st0);
  apply_segment_state(e_, pair.b.counts, pair.b.seq, pair.b.fixed_final);
  if (!pair.b.fsdp.empty()) p.roots[a.stage]->memo_apply(pair.b.fsdp.front());
  std::erase_if(e_.phantoms, [&](const Engine::PhantomGraph& g) { return g.graph == ph.graph; });
  phantoms_.erase(it);
  ++replayed_;
  return true;
}

}  // namespace trainmem::sim
