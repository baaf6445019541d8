package main

import (
	"slices"
	"strings"
	"testing"
)

func TestParseCPUPlan(t *testing.T) {
	allowed := []int{0, 1, 2, 3, 6}
	for _, tc := range []struct {
		list       string
		pg, rest   []int
		wantErrHas string
	}{
		{list: ""},
		{list: "0", pg: []int{0}, rest: []int{1, 2, 3, 6}},
		{list: "0-2, 6", pg: []int{0, 1, 2, 6}, rest: []int{3}},
		{list: "0-3,6", wantErrHas: "leave at least one"},
		{list: "4", wantErrHas: "CPU 4 is not one the bench may use (CPUs 0,1,2,3,6)"},
		{list: "2-1", wantErrHas: "not a CPU number or range"},
		{list: "a", wantErrHas: "not a CPU number or range"},
		{list: "-1", wantErrHas: "not a CPU number or range"},
	} {
		p, err := parseCPUPlan(tc.list, allowed)
		if tc.wantErrHas != "" {
			if err == nil || !strings.Contains(err.Error(), tc.wantErrHas) {
				t.Errorf("%q: error %v, want one saying %q", tc.list, err, tc.wantErrHas)
			}
			continue
		}
		if err != nil || !slices.Equal(p.Postgres, tc.pg) || !slices.Equal(p.Rest, tc.rest) || p.on() != (tc.pg != nil) {
			t.Errorf("%q: %+v, %v; want Postgres %v, the rest %v", tc.list, p, err, tc.pg, tc.rest)
		}
	}
}
