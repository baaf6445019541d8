package main

import (
	"errors"
	"os"
	"time"
)

// notMeasured marks a CPU figure that does not apply to a workload.
const notMeasured time.Duration = -1

// usage is the CPU time each party spent during a measurement, or
// notMeasured.
type usage struct {
	Forwarder time.Duration // jetbox or the polling relay (its own process)
	Postgres  time.Duration // every Postgres process, walsenders included
	NATS      time.Duration // the NATS server process
	// NATSKernel is NATS' part spent in the kernel: writing its file store
	// goes through the page cache, whose cost can grow with what was written.
	NATSKernel time.Duration
	Client     time.Duration // pg_recvlogical, or the bench itself for the raw publish runs
}

// total adds up the figures that were measured.
func (u usage) total() time.Duration {
	var t time.Duration
	for _, d := range []time.Duration{u.Forwarder, u.Postgres, u.NATS, u.Client} {
		if d > 0 {
			t += d
		}
	}
	return t
}

// meter measures the CPU the servers, a forwarder and the bench spend from
// its start.
type meter struct {
	srv                                 *servers
	fwd, pg, nats, natsKernel, selfTime time.Duration
	host                                hostSnapshot
}

// startMeter reads the CPU time the servers, fwd (nil: one not started yet,
// measured from its start) and the bench used so far.
func (b *bench) startMeter(fwd *process) (*meter, error) {
	m := &meter{srv: b.srv}
	var err1, err2, err3, err4, err5 error
	m.pg, err1 = b.srv.postgresCPU()
	m.nats, err2 = b.srv.nats.cpu()
	m.natsKernel, err5 = b.srv.nats.kernelCPU()
	m.selfTime, err3 = processCPU(os.Getpid())
	if fwd != nil {
		m.fwd, err4 = fwd.cpu()
	}
	var err6 error
	m.host, err6 = readHost(b.srv.nats.pid())
	return m, errors.Join(err1, err2, err3, err4, err5, err6)
}

// hostUsage is what the host's kernel did since the meter started: reclaim
// and the NATS server's system calls.
func (m *meter) hostUsage() (*hostUsage, error) {
	now, err := readHost(m.srv.nats.pid())
	if err != nil {
		return nil, err
	}
	u := m.host.since(now)
	return &u, nil
}

// read returns what was spent since the meter started by fwd (when not nil),
// Postgres and NATS, and, with client set, by the bench process itself.
func (m *meter) read(fwd *process, client bool) (usage, error) {
	u := usage{Forwarder: notMeasured, Client: notMeasured}
	pg, err1 := m.srv.postgresCPU()
	nats, err2 := m.srv.nats.cpu()
	natsKernel, err5 := m.srv.nats.kernelCPU()
	u.Postgres, u.NATS, u.NATSKernel = pg-m.pg, nats-m.nats, natsKernel-m.natsKernel
	var err3, err4 error
	if fwd != nil {
		u.Forwarder, err3 = fwd.cpu()
		u.Forwarder -= m.fwd
	}
	if client {
		var self time.Duration
		self, err4 = processCPU(os.Getpid())
		u.Client = self - m.selfTime
	}
	return u, errors.Join(err1, err2, err3, err4, err5)
}

// throughput is the result of one catch-up style workload: a backlog of
// Events drained (or published) as fast as possible.
type throughput struct {
	Name    string
	Events  int
	Elapsed time.Duration // from the forwarder's (or publisher's) start to the last event stored
	Span    time.Duration // from the first to the last event stored; 0 where unknown
	CPU     usage
	RSS     int64      // the forwarder's peak RSS; 0 where not measured
	Host    *hostUsage // the host's reclaim and the NATS server's system calls; nil where not measured
	Note    string
	Err     error // the run failed or its output was wrong
}

// rate is events per second: over the stored span where known (start-up
// excluded; start-up is measured on its own), else over the elapsed time.
func (t *throughput) rate() float64 {
	if t == nil || t.Err != nil {
		return 0
	}
	if t.Span > 0 && t.Events > 1 {
		return float64(t.Events-1) / t.Span.Seconds()
	}
	if t.Elapsed > 0 {
		return float64(t.Events) / t.Elapsed.Seconds()
	}
	return 0
}

// cpuPerEvent is the total measured CPU per event.
func (t *throughput) cpuPerEvent() time.Duration {
	if t == nil || t.Events == 0 {
		return 0
	}
	return t.CPU.total() / time.Duration(t.Events)
}
