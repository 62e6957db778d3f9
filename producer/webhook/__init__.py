"""``pagestream webhook``: the job-event firehose (``ps:events``) POSTed to a URL, signed the Standard
Webhooks way, at least once through a Redis consumer group (issue 27)."""
