//go:build !race

package main

// raceEnabled reports that the tests were built with -race (see race_test.go).
const raceEnabled = false
