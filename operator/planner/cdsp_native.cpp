// Tetris's CDSP planner (Algorithms 1-3, GetGroup, Eq. (2); Tetris §5.1) in C++, for the
// paper's latency bar (Table 2: 22.8-30.6 us on average per request). It is the same algorithm
// as cdsp.py and instance_pool.py, step for step and in the same floating-point order, so both
// give identical plans (tests/planner/test_cdsp_native.py compares them); cdsp.py documents the
// rules, this file only says where it departs in form.
//
// A CPython extension module (``gearshift_cdsp_native.plan``), built on first use by native.py
// with -ffp-contract=off (no fused multiply-add: the Python arithmetic rounds after every
// operation). It reads the pool's dict and node list directly, so a call costs microseconds.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <deque>
#include <limits>
#include <memory>
#include <utility>
#include <vector>

namespace {

struct Entry {
  double t;  // queueing seconds T_k
  int id;
};

struct Found {
  bool ok = false;
  std::vector<int> group;
  double wait = 0.0;
};

struct Model {
  double a, b, c, d;

  double seconds(double history, double length) const {
    return a + length * (b + c * history + d * length);
  }

  // LatencyModel.max_length: the closed-form root of Eq. (1) for a budget.
  double max_length(double budget, double history) const {
    const double lin = b + c * history;
    const double cst = a - budget;
    if (cst > 0) return 0.0;
    if (d > 0) {
      const double root = std::sqrt(lin * lin - 4.0 * d * cst);
      return lin > 0 ? (-2.0 * cst) / (lin + root) : (root - lin) / (2.0 * d);
    }
    if (d == 0) return lin > 0 ? -cst / lin : std::numeric_limits<double>::infinity();
    const double disc = lin * lin - 4.0 * d * cst;
    if (lin <= 0 || disc < 0) return std::numeric_limits<double>::infinity();
    return (lin - std::sqrt(disc)) / (-2.0 * d);
  }
};

// Python's float floor division (Objects/floatobject.c), so rounding at a chunk-granularity
// boundary matches cdsp.py's ``fit // granularity`` exactly.
double py_floordiv(double vx, double wx) {
  double mod = std::fmod(vx, wx);
  double div = (vx - mod) / wx;
  if (mod != 0.0 && ((wx < 0) != (mod < 0))) div -= 1.0;
  if (div != 0.0) {
    double floordiv = std::floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
    return floordiv;
  }
  return std::copysign(0.0, vx / wx);
}

// One node's instances: a view into its pool's flat entry array (which never moves once built).
struct Run {
  const Entry* b;
  const Entry* e;
  size_t size() const { return static_cast<size_t>(e - b); }
  const Entry& operator[](size_t i) const { return b[i]; }
  const Entry& back() const { return e[-1]; }
  const Entry* begin() const { return b; }
  const Entry* end() const { return e; }
};

struct Span {
  int node;
  size_t begin, end;
};

struct Pool;
using PoolPtr = std::shared_ptr<Pool>;

// instance_pool.Pool: per node, its instances sorted by (T, id); nodes in ascending id. All
// entries sit in one array (one allocation per pool: the search makes a pool per branch).
struct Pool {
  const std::vector<int>* node_of;  // node of every instance id of the whole pool
  std::vector<Entry> flat;
  std::vector<std::pair<int, Run>> nodes;
  std::vector<double> queue;  // T by instance id; NaN for ids outside this pool
  int count = 0;              // instances in this pool
  int largest = 0;
  std::vector<std::vector<std::pair<double, int>>> kth;  // by k, computed on demand
  std::vector<char> kth_done;
  std::vector<int> whole;  // node indexes, see whole_order
  bool whole_done = false;
  struct Cached {
    std::vector<int> initial;
    int size;
    Found found;
  };
  std::deque<Cached> cache;  // a deque: references to earlier entries stay valid

  void finish(const std::vector<Span>& spans) {
    nodes.reserve(spans.size());
    for (auto& sp : spans) nodes.push_back({sp.node, Run{&flat[sp.begin], &flat[0] + sp.end}});
    largest = 0;
    count = 0;
    for (auto& n : nodes) {
      largest = std::max<int>(largest, static_cast<int>(n.second.size()));
      count += static_cast<int>(n.second.size());
    }
  }

  const Run* entries_of(int node) const {
    for (auto& n : nodes)
      if (n.first == node) return &n.second;
    return nullptr;
  }

  const std::vector<std::pair<double, int>>& kth_order(int k) {
    if (static_cast<int>(kth.size()) <= k) {
      kth.resize(k + 1);
      kth_done.resize(k + 1, 0);
    }
    if (!kth_done[k]) {
      auto& order = kth[k];
      for (size_t i = 0; i < nodes.size(); ++i)
        if (static_cast<int>(nodes[i].second.size()) >= k)
          order.emplace_back(nodes[i].second[k - 1].t, static_cast<int>(i));
      // (k-th T, node id): node indexes follow node ids, so sorting by index is by id.
      std::sort(order.begin(), order.end());
      kth_done[k] = 1;
    }
    return kth[k];
  }

  const std::vector<int>& whole_order() {
    if (!whole_done) {
      whole.resize(nodes.size());
      for (size_t i = 0; i < nodes.size(); ++i) whole[i] = static_cast<int>(i);
      std::sort(whole.begin(), whole.end(), [this](int x, int y) {
        const auto& ex = nodes[x].second;
        const auto& ey = nodes[y].second;
        if (ex.back().t != ey.back().t) return ex.back().t < ey.back().t;
        if (ex.size() != ey.size()) return ex.size() > ey.size();
        return x < y;
      });
      whole_done = true;
    }
    return whole;
  }

  const Found& group(const std::vector<int>& initial, int size);

  PoolPtr restrict_to(const PoolPtr& self, const std::vector<int>& group) const {
    if (static_cast<int>(group.size()) == count) return self;
    auto out = std::make_shared<Pool>();
    out->node_of = node_of;
    out->queue.assign(queue.size(), std::numeric_limits<double>::quiet_NaN());
    for (int i : group) out->queue[i] = queue[i];
    out->flat.reserve(group.size());
    std::vector<Span> spans;
    for (auto& n : nodes) {
      const size_t b = out->flat.size();
      for (auto& e : n.second)
        if (!std::isnan(out->queue[e.id])) out->flat.push_back(e);
      if (out->flat.size() > b) spans.push_back({n.first, b, out->flat.size()});
    }
    out->finish(spans);
    return out;
  }

  // Eq. (2): T <- max(0, T - elapsed); instances that tie at 0 go back to id order.
  PoolPtr advance(double elapsed) const {
    auto out = std::make_shared<Pool>();
    out->node_of = node_of;
    out->queue.assign(queue.size(), std::numeric_limits<double>::quiet_NaN());
    out->flat.reserve(flat.size());
    std::vector<Span> spans;
    spans.reserve(nodes.size());
    for (auto& n : nodes) {
      const size_t b = out->flat.size();
      for (auto& e : n.second) out->flat.push_back({e.t > elapsed ? e.t - elapsed : 0.0, e.id});
      auto first = out->flat.begin() + static_cast<std::ptrdiff_t>(b);
      if (first->t == 0.0) {
        auto free = first;
        while (free != out->flat.end() && free->t == 0.0) ++free;
        std::sort(first, free, [](const Entry& x, const Entry& y) { return x.id < y.id; });
      }
      for (auto it = first; it != out->flat.end(); ++it) out->queue[it->id] = it->t;
      spans.push_back({n.first, b, out->flat.size()});
    }
    out->finish(spans);
    return out;
  }
};

bool contains(const std::vector<int>& xs, int x) {
  return std::find(xs.begin(), xs.end(), x) != xs.end();
}

// instance_pool._fresh: ``need`` instances from nodes outside ``taken``.
bool fresh(Pool& pool, std::vector<int> taken, int need, std::vector<int>& out, double& wait_out) {
  double wait = 0.0;
  const auto& wholes = pool.whole_order();
  size_t pos = 0;
  while (true) {
    if (need <= pool.largest) {
      for (auto& [t, idx] : pool.kth_order(need)) {
        if (!contains(taken, pool.nodes[idx].first)) {
          const auto& e = pool.nodes[idx].second;
          for (int j = 0; j < need; ++j) out.push_back(e[j].id);
          wait_out = std::max(wait, t);
          return true;
        }
      }
    }
    while (pos < wholes.size() && contains(taken, pool.nodes[wholes[pos]].first)) ++pos;
    if (pos == wholes.size()) return false;
    const auto& n = pool.nodes[wholes[pos]];
    taken.push_back(n.first);
    for (auto& e : n.second) out.push_back(e.id);
    wait = std::max(wait, n.second.back().t);
    need -= static_cast<int>(n.second.size());
  }
}

// instance_pool.extend (GetGroup with the group's wait).
Found extend(Pool& pool, const std::vector<int>& initial, int size) {
  Found f;
  int need = size - static_cast<int>(initial.size());
  if (need < 0) return f;
  double wait = 0.0;
  if (!initial.empty()) {
    wait = pool.queue[initial[0]];
    for (int i : initial) wait = std::max(wait, pool.queue[i]);
  }
  f.group = initial;
  if (need == 0) {
    f.ok = true;
    f.wait = wait;
    return f;
  }
  std::vector<int> used;
  for (int i : initial) {
    int n = (*pool.node_of)[i];
    if (!contains(used, n)) used.push_back(n);
  }
  if (!used.empty()) {
    // The used nodes' instances outside ``initial``, shortest (T, id) first: each node's list is
    // already in that order, so merge them and stop at ``need`` (instance_pool sorts them all).
    static thread_local std::vector<char> mine;
    if (mine.size() < pool.queue.size()) mine.resize(pool.queue.size(), 0);
    for (int i : initial) mine[i] = 1;
    std::vector<std::pair<const Run*, size_t>> heads;
    for (int n : used)
      if (const auto* es = pool.entries_of(n)) heads.push_back({es, 0});
    double last = 0.0;
    int took = 0;
    while (took < need) {
      int best = -1;
      for (size_t h = 0; h < heads.size(); ++h) {
        auto& [es, at] = heads[h];
        while (at < es->size() && mine[(*es)[at].id]) ++at;
        if (at == es->size()) continue;
        if (best < 0) {
          best = static_cast<int>(h);
          continue;
        }
        const Entry& x = (*es)[at];
        const Entry& y = (*heads[best].first)[heads[best].second];
        if (x.t < y.t || (x.t == y.t && x.id < y.id)) best = static_cast<int>(h);
      }
      if (best < 0) break;
      const Entry& e = (*heads[best].first)[heads[best].second++];
      f.group.push_back(e.id);
      last = e.t;
      ++took;
    }
    for (int i : initial) mine[i] = 0;
    if (took > 0) {
      wait = std::max(wait, last);
      need -= took;
    }
  }
  if (need) {
    double w = 0.0;
    if (!fresh(pool, used, need, f.group, w)) {
      f.group.clear();
      return f;
    }
    wait = std::max(wait, w);
  }
  f.ok = true;
  f.wait = wait;
  return f;
}

const Found& Pool::group(const std::vector<int>& initial, int size) {
  for (auto& c : cache)
    if (c.size == size && c.initial == initial) return c.found;
  cache.push_back({initial, size, extend(*this, initial, size)});
  return cache.back().found;
}

struct RawChunk {
  long long length;
  std::vector<int> group;
  double wait, seconds;
};

struct Raw {
  bool ok = false;
  double ttft = 0.0;
  std::vector<RawChunk> chunks;
};

struct Search {
  std::vector<int> all_sizes;
  std::vector<Model> model_by_size;  // indexed by SP size
  long long granularity;
  double rate;
  bool bounded;
  double min_a;

  const Model& model(int s) const { return model_by_size[s]; }

  double lower_bound(long long length, long long history, const std::vector<int>& sizes) const {
    if (!bounded) return -std::numeric_limits<double>::infinity();
    double best = std::numeric_limits<double>::infinity();
    bool first = true;
    for (int s : sizes) {
      const double v = model(s).b + model(s).c * static_cast<double>(history);
      if (first || v < best) best = v;
      first = false;
    }
    return min_a + static_cast<double>(length) * best;
  }

  // cdsp.single_chunk (Algorithm 2).
  bool single_chunk(long long length, long long history, const std::vector<int>& initial,
                    const std::vector<int>& sizes, Pool& pool, RawChunk& out) const {
    struct Option {
      const Found* found;
      double seconds, total;
    };
    std::vector<Option> options;
    for (int s : sizes) {
      const Found& f = pool.group(initial, s);
      if (!f.ok) continue;
      const double secs =
          model(s).seconds(static_cast<double>(history), static_cast<double>(length));
      options.push_back({&f, secs, f.wait + secs});
    }
    if (options.empty()) return false;
    const double keep = 1.0 - rate;
    size_t pick = options.size() - 1;
    double best_after = options[pick].total;
    for (size_t j = options.size() - 1; j-- > 0;) {
      if (best_after >= options[j].total * keep) pick = j;
      best_after = std::min(best_after, options[j].total);
    }
    out.length = length;
    out.group = options[pick].found->group;
    out.wait = options[pick].found->wait;
    out.seconds = options[pick].seconds;
    return true;
  }

  // cdsp._Search.schedule (Algorithm 1 with Algorithm 3's chunk lengths).
  Raw schedule(long long length, long long history, const std::vector<int>& initial,
               const std::vector<int>& sizes, const PoolPtr& pool, int chunks_left) const {
    Raw best;
    RawChunk one;
    if (!single_chunk(length, history, initial, sizes, *pool, one)) return best;
    const double wait0 = one.wait;
    const int group0_size = static_cast<int>(one.group.size());
    best.ok = true;
    best.ttft = one.wait + one.seconds;
    const std::vector<int> group0 = one.group;
    best.chunks.push_back(std::move(one));
    if (chunks_left <= 1) return best;
    std::vector<int> cdsp;
    for (int s : sizes)
      if (s <= group0_size) cdsp.push_back(s);
    if (cdsp.size() < 2) return best;
    PoolPtr inner = pool->restrict_to(pool, group0);
    for (size_t k = 0; k + 1 < cdsp.size(); ++k) {
      const int s_cur = cdsp[k];
      const Found found = inner->group(initial, s_cur);  // a copy: the cache may grow below
      if (!found.ok) continue;
      const double wait_cur = found.wait;
      const Model& m = model(s_cur);
      const double least = static_cast<double>(std::max<long long>(granularity, s_cur));
      if (m.max_length(wait0 - wait_cur, static_cast<double>(history)) < least) continue;
      for (size_t k2 = k + 1; k2 < cdsp.size(); ++k2) {
        const int s_next = cdsp[k2];
        const Found& following = inner->group(found.group, s_next);
        if (!following.ok) continue;
        const double budget = following.wait - wait_cur;
        const double fit = m.max_length(budget, static_cast<double>(history));
        long long n;
        if (fit >= static_cast<double>(length)) {
          n = length;
        } else {
          n = static_cast<long long>(py_floordiv(fit, static_cast<double>(granularity))) *
              granularity;
        }
        if (n < std::max<long long>(granularity, s_cur) || n >= length) continue;
        const double seconds = m.seconds(static_cast<double>(history), static_cast<double>(n));
        const double elapsed = wait_cur + seconds;
        std::vector<int> rest;
        for (int s : cdsp)
          if (s >= s_next) rest.push_back(s);
        if (elapsed + lower_bound(length - n, history + n, rest) >= best.ttft) continue;
        Raw sub = schedule(length - n, history + n, found.group, rest, inner->advance(elapsed),
                           chunks_left - 1);
        if (sub.ok && elapsed + sub.ttft < best.ttft) {
          best.ttft = elapsed + sub.ttft;
          best.chunks.clear();
          best.chunks.push_back({n, found.group, wait_cur, seconds});
          for (auto& c : sub.chunks) best.chunks.push_back(std::move(c));
        }
      }
    }
    return best;
  }
};

// plan(length, queue, node_of, sizes, coef, granularity, max_chunks, improvement_rate):
// ``queue`` maps instance id -> T, ``node_of`` is every id's node, ``sizes`` the SP sizes and
// ``coef`` their Eq. (1) coefficients (a, b, c, d each, flat). Returns a list of (length, group,
// wait after the previous chunk, seconds), or None when no SP size fits the pool.
PyObject* plan(PyObject*, PyObject* args) {
  long long length, granularity;
  int max_chunks;
  double rate;
  PyObject *queue, *node_seq, *size_seq, *coef_seq;
  if (!PyArg_ParseTuple(args, "LO!OOOLid", &length, &PyDict_Type, &queue, &node_seq, &size_seq,
                        &coef_seq, &granularity, &max_chunks, &rate))
    return nullptr;
  if (length < 1 || granularity < 1 || max_chunks < 1) {
    PyErr_SetString(PyExc_ValueError, "length, granularity and max_chunks must be at least 1");
    return nullptr;
  }
  PyObject* nodes_fast = PySequence_Fast(node_seq, "node_of must be a sequence");
  if (!nodes_fast) return nullptr;
  const Py_ssize_t n_ids = PySequence_Fast_GET_SIZE(nodes_fast);
  std::vector<int> nodes_of(n_ids);
  for (Py_ssize_t i = 0; i < n_ids; ++i)
    nodes_of[i] = static_cast<int>(PyLong_AsLong(PySequence_Fast_GET_ITEM(nodes_fast, i)));
  Py_DECREF(nodes_fast);
  if (PyErr_Occurred()) return nullptr;

  auto pool = std::make_shared<Pool>();
  pool->node_of = &nodes_of;
  pool->queue.assign(n_ids, std::numeric_limits<double>::quiet_NaN());
  std::vector<std::pair<int, Entry>> all;
  all.reserve(PyDict_Size(queue));
  Py_ssize_t pos = 0;
  PyObject *key, *value;
  while (PyDict_Next(queue, &pos, &key, &value)) {
    const long id = PyLong_AsLong(key);
    const double t = PyFloat_AsDouble(value);
    if (PyErr_Occurred()) return nullptr;
    if (id < 0 || id >= n_ids) {
      PyErr_Format(PyExc_ValueError, "instance %ld has no node in node_of", id);
      return nullptr;
    }
    pool->queue[id] = t;
    all.push_back({nodes_of[id], {t, static_cast<int>(id)}});
  }
  std::sort(all.begin(), all.end(), [](const auto& x, const auto& y) {
    if (x.first != y.first) return x.first < y.first;
    if (x.second.t != y.second.t) return x.second.t < y.second.t;
    return x.second.id < y.second.id;
  });
  pool->flat.reserve(all.size());
  std::vector<Span> spans;
  for (auto& [n, e] : all) {
    if (spans.empty() || spans.back().node != n)
      spans.push_back({n, pool->flat.size(), pool->flat.size()});
    pool->flat.push_back(e);
    spans.back().end = pool->flat.size();
  }
  pool->finish(spans);

  PyObject* sizes_fast = PySequence_Fast(size_seq, "sizes must be a sequence");
  if (!sizes_fast) return nullptr;
  PyObject* coef_fast = PySequence_Fast(coef_seq, "coef must be a sequence");
  if (!coef_fast) {
    Py_DECREF(sizes_fast);
    return nullptr;
  }
  const Py_ssize_t n_sizes = PySequence_Fast_GET_SIZE(sizes_fast);
  bool ok = n_sizes >= 1 && PySequence_Fast_GET_SIZE(coef_fast) == 4 * n_sizes;
  Search search;
  search.bounded = true;
  search.min_a = std::numeric_limits<double>::infinity();
  std::vector<std::pair<int, Model>> models;
  for (Py_ssize_t j = 0; ok && j < n_sizes; ++j) {
    const long s = PyLong_AsLong(PySequence_Fast_GET_ITEM(sizes_fast, j));
    double c[4];
    for (int k = 0; k < 4; ++k)
      c[k] = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(coef_fast, 4 * j + k));
    ok = !PyErr_Occurred() && s >= 1 && s <= 1 << 20;
    if (ok) models.push_back({static_cast<int>(s), Model{c[0], c[1], c[2], c[3]}});
  }
  Py_DECREF(sizes_fast);
  Py_DECREF(coef_fast);
  if (!ok) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "bad SP sizes or coefficients");
    return nullptr;
  }
  int max_size = 0;
  for (auto& [s, m] : models) max_size = std::max(max_size, s);
  search.model_by_size.assign(max_size + 1, Model{0, 0, 0, 0});
  for (auto& [s, m] : models) {
    search.model_by_size[s] = m;
    search.all_sizes.push_back(s);
    search.bounded = search.bounded && std::min(std::min(m.a, m.b), std::min(m.c, m.d)) >= 0;
    search.min_a = std::min(search.min_a, m.a);
  }
  std::sort(search.all_sizes.begin(), search.all_sizes.end());
  search.granularity = granularity;
  search.rate = rate;

  const Raw raw = search.schedule(length, 0, {}, search.all_sizes, pool, max_chunks);
  if (!raw.ok) Py_RETURN_NONE;
  PyObject* out = PyList_New(static_cast<Py_ssize_t>(raw.chunks.size()));
  if (!out) return nullptr;
  for (size_t j = 0; j < raw.chunks.size(); ++j) {
    const RawChunk& c = raw.chunks[j];
    PyObject* group = PyTuple_New(static_cast<Py_ssize_t>(c.group.size()));
    if (!group) {
      Py_DECREF(out);
      return nullptr;
    }
    for (size_t k = 0; k < c.group.size(); ++k)
      PyTuple_SET_ITEM(group, static_cast<Py_ssize_t>(k), PyLong_FromLong(c.group[k]));
    PyObject* item = Py_BuildValue("(LNdd)", c.length, group, c.wait, c.seconds);
    if (!item) {
      Py_DECREF(out);
      return nullptr;
    }
    PyList_SET_ITEM(out, static_cast<Py_ssize_t>(j), item);
  }
  return out;
}

PyMethodDef methods[] = {
    {"plan", plan, METH_VARARGS, "Algorithm 1 for one request (see cdsp_native.cpp)."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef module = {PyModuleDef_HEAD_INIT, "gearshift_cdsp_native", nullptr, -1, methods};

}  // namespace

PyMODINIT_FUNC PyInit_gearshift_cdsp_native() { return PyModule_Create(&module); }
