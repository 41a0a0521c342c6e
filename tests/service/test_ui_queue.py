"""The web UI's queue view (#/queue): waiting jobs in the scheduler's order with their position and
reason, and the cluster's capacity against what is allocated, in a real headless Chromium
(skips naming chromium / chromedriver when they are missing, like tests/service/test_ui.py)."""

from __future__ import annotations

from tests.service.test_scheduling import fake, scheduled, spec, submit  # noqa: F401 (fixture)
from tests.service.test_ui import browser, ready_after, sign_in  # noqa: F401 (fixture)
from tests.waiting import wait_for


def test_the_queue_view_shows_order_reasons_and_cluster_use(start_env, fake, browser):  # noqa: F811
    from selenium.webdriver.common.by import By

    env = start_env(fake)
    scheduled(env)
    running = submit(env, {**spec("holder", ranks=3), "training": {"train_iters": 8, "global_batch_size": 6}})
    env.wait_state(running, "starting")
    big = submit(env, spec("big", ranks=4))
    small = submit(env, spec("small", ranks=2))
    wait_for(lambda: env.job(small)["queue_position"] == 2, what="small second in the queue")
    sign_in(browser, env.server.url, env.tokens["alice"])
    wait_for(lambda: browser.execute_script("return window.elastronReady"), 20, "the jobs list")
    ready_after(browser, "#/queue")
    rows = browser.find_elements(By.CSS_SELECTOR, "#queue-table tr.queue-row")
    assert [r.get_attribute("data-id") for r in rows] == [big, small]
    first, second = (r.find_elements(By.TAG_NAME, "td") for r in rows)
    assert first[0].text == "1" and first[5].text.startswith("needs 4 ranks x (1 CPU, 0 GPU), 1 free")
    assert second[0].text == "2" and "behind 1 job(s)" in second[5].text
    cpus = browser.find_element(By.ID, "use-cpus")
    assert (cpus.get_attribute("data-used"), cpus.get_attribute("data-total")) == ("3", "4")
    assert "3.000 / 4.000 allocated (75%)" in cpus.text
    rows[0].click()  # a row opens its job
    wait_for(lambda: browser.find_elements(By.ID, "job-page"), 20, "the job page")
    assert browser.execute_script("return location.hash") == f"#/jobs/{big}"
