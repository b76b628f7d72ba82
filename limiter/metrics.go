package limiter

import "github.com/prometheus/client_golang/prometheus"

// The metrics are read at scrape time from the counters the draws keep in
// their shards (a shard per processor for a key-less limit, per part of
// the table for a keyed one): a draw pays nothing for them.
var (
	descAdmitted = prometheus.NewDesc("rlagent_limiter_admitted_total",
		"Draws the limit admitted.", []string{"limit"}, nil)
	descWaited = prometheus.NewDesc("rlagent_limiter_waited_total",
		"Draws the limit admitted after a wait (onEmpty wait).", []string{"limit"}, nil)
	descFailed = prometheus.NewDesc("rlagent_limiter_failed_total",
		"Draws the limit refused (with shadow: would have refused, and admitted).", []string{"limit"}, nil)
	descUnknown = prometheus.NewDesc("rlagent_limiter_unknown_total",
		"Draws that named the limit while it was not configured (admitted).", []string{"limit"}, nil)
	descRate = prometheus.NewDesc("rlagent_limiter_share_rate",
		"The limit's share at this replica, in requests per second.", []string{"limit"}, nil)
	descBurst = prometheus.NewDesc("rlagent_limiter_share_burst",
		"The limit's share of the burst at this replica.", []string{"limit"}, nil)
	descGlobal = prometheus.NewDesc("rlagent_limiter_global_rate",
		"The limit's global rate, over all replicas.", []string{"limit"}, nil)
	descReplicas = prometheus.NewDesc("rlagent_limiter_replicas",
		"The replica count the limit was divided by.", []string{"limit"}, nil)
	descAge = prometheus.NewDesc("rlagent_limiter_count_age_seconds",
		"The time since the limit's replica count was last confirmed (0: a count that never ages).", []string{"limit"}, nil)
	descKeys = prometheus.NewDesc("rlagent_limiter_keys",
		"Keys a keyed limit holds.", []string{"limit"}, nil)
	descEvicted = prometheus.NewDesc("rlagent_limiter_evictions_total",
		"Keys a keyed limit evicted to make room.", []string{"limit"}, nil)
)

type collector struct{ l *Limiter }

func (c *collector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range []*prometheus.Desc{descAdmitted, descWaited, descFailed, descUnknown, descRate, descBurst,
		descGlobal, descReplicas, descAge, descKeys, descEvicted} {
		ch <- d
	}
}

func (c *collector) Collect(ch chan<- prometheus.Metric) {
	l := c.l
	ager, _ := l.opts.Source.(CountAger)
	l.mu.Lock()
	defer l.mu.Unlock()
	for name, lim := range l.limits {
		counter := func(d *prometheus.Desc, v uint64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, float64(v), name)
		}
		gauge := func(d *prometheus.Desc, v float64) {
			ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, name)
		}
		a, f, w, e := lim.base.admitted, lim.base.failed, lim.base.waited, lim.base.evicted
		p := lim.p.Load()
		if p != nil {
			pa, pf, pw, pe := p.counts()
			a, f, w, e = a+pa, f+pf, w+pw, e+pe
		}
		counter(descAdmitted, a)
		counter(descWaited, w)
		counter(descFailed, f)
		counter(descUnknown, lim.unknown.Load())
		if p == nil {
			continue
		}
		gauge(descRate, p.cfg.Rate)
		gauge(descBurst, float64(p.cfg.Burst))
		gauge(descGlobal, float64(p.cfg.GlobalRate))
		gauge(descReplicas, float64(p.cfg.Replicas))
		if ager != nil {
			gauge(descAge, ager.CountAge(name).Seconds())
		}
		if p.t != nil {
			_, _, _, keys, _ := p.t.counts()
			gauge(descKeys, float64(keys))
			counter(descEvicted, e)
		}
	}
}
