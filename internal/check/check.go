// Package check holds the result type of jetbox's preflight checks, shared by
// the Postgres side (replication) and the NATS side (sink).
package check

// Severity of a finding.
type Severity string

// Severities, from fatal to informative.
const (
	Error   Severity = "error"   // jetbox cannot run until it is fixed
	Create  Severity = "create"  // missing; `jetbox run` creates it
	Warning Severity = "warning" // jetbox runs, but look at it
	Info    Severity = "info"    // a fact worth knowing
)

// Finding is one result of a check.
type Finding struct {
	Severity Severity `json:"severity"`
	Check    string   `json:"check"` // e.g. "postgres.wal_level"
	What     string   `json:"what"`
	Hint     string   `json:"fix,omitempty"`
}

// Fatal reports whether any finding is an error.
func Fatal(fs []Finding) bool {
	for _, f := range fs {
		if f.Severity == Error {
			return true
		}
	}
	return false
}

// Named returns the findings of the check named name, in order.
func Named(fs []Finding, name string) []Finding {
	var out []Finding
	for _, f := range fs {
		if f.Check == name {
			out = append(out, f)
		}
	}
	return out
}

// List collects findings.
type List []Finding

// Add appends a finding.
func (l *List) Add(sev Severity, check, what, fix string) {
	*l = append(*l, Finding{Severity: sev, Check: check, What: what, Hint: fix})
}
