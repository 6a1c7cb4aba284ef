//go:build race

package main

// raceEnabled reports that the tests were built with -race: TestDockerCompose then builds
// cmd/enqueue with -race too, reusing the packages the test build compiled.
const raceEnabled = true
